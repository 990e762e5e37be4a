"""`python -m eqtrain.cli`: the same as the `eqtrain` command."""

from . import main


main()
