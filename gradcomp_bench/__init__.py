"""The benchmark harness behind ``gradcomp-bench`` (``pip install 'gradcomp[bench]'``).

It imports the library, ``gradcomp``, and never the other way round: the library installs
and runs with torch and numpy alone.
"""
