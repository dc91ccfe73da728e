"""Runtime: running a ``.pte`` with the cell cache (``runner``: the program and
its cache; ``scheduler``: continuous batching and admission; ``pools``: the
cache's pools as admission counts them; ``sampling``;
``tokenizer``: the tokenizers a program carries).

May import ``cache`` only: a program is run from its file and metadata, never
from export code.
"""
