import sys
from pathlib import Path

# The repo root must be importable (broadcast/, swarm/) whether or not the project is pip-installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
