"""Pure math, no I/O: the reranker, Gumbel top-M sampling and Plackett–Luce log-probs,
the losses, metrics, typed state and one update step."""
