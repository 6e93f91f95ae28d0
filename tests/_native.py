"""Which kernel path this test session runs, for tests that need the native library.

``needs_native`` skips a test that needs the native library's row invariance when the session
runs the torch fallback, with the loader's reason (``pytest -ra`` lists it; the session header
also names the kernel path, see conftest.py). The fallback itself is exercised by
tests/kernels/test_native_loader.py, which decodes with ``EXITLM_NATIVE=0``.
"""

from __future__ import annotations

import pytest

from exitlm.kernels import native

needs_native = pytest.mark.skipif(
    not native.available(),
    reason=f"needs the native kernels' row invariance; this session runs "
           f"{native.kernel_path().describe()}")
