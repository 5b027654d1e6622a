"""Helpers shared by several test modules (plain functions and classes; fixtures live in conftest.py)."""
