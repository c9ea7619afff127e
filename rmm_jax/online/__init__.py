"""The online layer: streams → the compiled loop (``loop``) → events (``driver``), plus
offline pretraining, prequential summaries and the comparison table."""
