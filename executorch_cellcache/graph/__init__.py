"""What goes into the exported graph: the ``cellcache::place`` / ``cellcache::mask``
torch ops (``ops``), the attention that writes and reads K/V at the placed cells
(``attention``) and the transformers integration (``model``).

May import ``cache`` only.
"""
