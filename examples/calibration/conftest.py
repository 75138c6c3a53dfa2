"""Lets the example's tests import the job module (calibrate.py) from this folder."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
