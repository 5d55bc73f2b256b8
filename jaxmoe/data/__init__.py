"""What training reads: corpora and their token shards, tokenizers, batches in epochs,
and `python -m jaxmoe.data.prepare`, which tokenizes a corpus once."""
