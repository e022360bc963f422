"""kvtier.tiers"""
