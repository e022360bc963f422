"""kvtier.scoring"""
