"""Entry point of every Python py_test: runs pytest on the files passed."""
import sys

import pytest

if __name__ == "__main__":
    sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-rs"] + sys.argv[1:]))
