"""Lets `python -m scripts.train` find the top-level scripts (train.py, ...) as scripts.<name>."""
import os

__path__.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
