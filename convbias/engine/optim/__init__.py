"""Optimization: parameter groups, optimizer, schedule, losses and EMA through timm's factories."""
