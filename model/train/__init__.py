"""Training data for the sibling model family: the local corpus, the tokenizer, long-range tasks, batches.

Knows nothing of the model's layers; builds token sequences and masks only. Entry point:
`python -m model.train data build --out DIR`.
"""
