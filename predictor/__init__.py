"""kvtier.predictor"""
