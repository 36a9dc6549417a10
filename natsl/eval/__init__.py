"""Evaluation and inspection of natsl checkpoints (docs/evaluation.md).

- `ppl`: per-token loss over full-length windows, bucketed by position (paper Fig. 3), and bits per byte.
- `ruler`: the RULER needle-in-a-haystack retrieval subset generated locally (paper Table 2).
- `routing`: the fraction of blocks each NAtS-L routing group keeps in softmax memory (paper Figs. 5
  and 6) and the KV memory that follows from it.
- `convert`: training checkpoint -> inference folder, and import of the authors' Hugging Face format.
- `decode`: greedy decoding through the incremental cache when the model has one.
"""
