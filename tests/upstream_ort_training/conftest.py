import sys
from pathlib import Path

# NOTE: the bindings tests import helpers from the onnxblock tests by module name, as upstream does
sys.path.insert(0, str(Path(__file__).parent))
