"""A user module whose import fails with something other than ImportError (as a CUDA extension or
a bad global can): dlpipe must report it in one line, not a traceback."""

raise RuntimeError("this extension was built for another torch")
