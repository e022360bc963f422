"""kvtier.kernels"""
