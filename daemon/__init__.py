"""kvtier.daemon"""
