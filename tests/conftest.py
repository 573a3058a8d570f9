"""Test set-up shared by every test file: the repo root on sys.path, and idle OpenMP threads that sleep
instead of spinning (on a busy 2-core machine spinning threads steal the cores they wait for)."""

import os
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is first imported
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
