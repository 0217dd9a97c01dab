"""``python -m keras_tfr.cli``: the ``keras-tfr`` command."""

import sys

from keras_tfr.cli import main

sys.exit(main())
