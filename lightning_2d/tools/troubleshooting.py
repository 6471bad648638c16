"""placeholder"""
REFUSALS: list = []
