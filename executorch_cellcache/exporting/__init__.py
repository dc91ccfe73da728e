"""Export: a transformers model or checkpoint folder -> a cell-cache ``.pte``
(``exporter``: the pipeline; ``lowering``: edge + XNNPACK; ``default_model``: the
embedded default model).

May import ``cache`` and ``graph``; never ``runtime`` or above. (Named
``exporting`` so that ``executorch_cellcache.export`` stays the function.)
"""
