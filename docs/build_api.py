"""Builds the offline API reference with pdoc: ``make docs`` (``python docs/build_api.py``).

Writes static HTML (no network at build or view time) into ``docs/api`` (git-ignored),
or into the directory given as the first argument. The public modules: ``keras_tfr``
(the names of its ``__all__``), ``keras_tfr.tuner``, ``keras_tfr.parallel`` and
``keras_tfr.distribute``. Docstrings are read as Google style.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

MODULES = ["keras_tfr", "keras_tfr.tuner", "keras_tfr.parallel", "keras_tfr.distribute"]


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else os.path.join(os.path.dirname(__file__), "api"))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    from keras_tfr._quiet import import_tensorflow_quietly

    import_tensorflow_quietly()  # pdoc imports every module, TensorFlow with them

    import pdoc
    import pdoc.render

    from keras_tfr import __version__

    shutil.rmtree(out, ignore_errors=True)
    pdoc.render.configure(docformat="google", footer_text=f"keras-tfr {__version__}")
    pdoc.pdoc(*MODULES, output_directory=out)
    pages = sorted(p.name for p in out.glob("**/*.html"))
    print(f"API reference: {len(pages)} pages in {out} (open {out / 'index.html'})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
