"""Every example in the docstrings of rmm_jax runs and prints what it claims, as a reader copies it.

Each docstring's examples run with clean globals (builtins and what the example itself
imports), as in a script: an example that uses a name of its own module without importing
it fails here, as it would for a user (doctest's default runs them in the module's namespace).

One test per module of the package (found on disk, so a new module is covered without
editing this file). The exported functions of rmm_jax.core, and the loop's entry points,
below must each carry a runnable example.
"""
import doctest
import importlib
import pkgutil

import pytest

import rmm_jax

MODULES = ["rmm_jax"] + sorted(m.name for m in pkgutil.walk_packages(rmm_jax.__path__, "rmm_jax."))

# Functions whose docstrings must hold an example (doctest finds them by qualified name).
DOCUMENTED = {
    "rmm_jax.core.config": ["preset", "Layout", "Estimator"],
    "rmm_jax.core.optim": ["adam", "sgd"],
    "rmm_jax.core.scope": ["Scope"],
    "rmm_jax.core.reranker": ["init_reranker", "init_lowrank", "merge_params", "score", "score_batch", "score_naive"],
    "rmm_jax.core.sampling": ["gumbel_top_m", "selection_log_prob", "selection_log_probs", "top_m"],
    "rmm_jax.core.losses": ["citation_rewards", "advantages", "reinforce_loss", "citation_logistic_loss",
                             "listwise_loss", "pointwise_loss"],
    "rmm_jax.core.metrics": ["recall_at_k", "recall_any_at_k", "recall_all_at_k", "ndcg_at_k", "mrr",
                             "summarize"],
    "rmm_jax.core.update": ["shared_step_multiple", "init_learner_state", "init_shared", "init_user", "make_update"],
    "rmm_jax.online.loop": ["make_run"],
    "rmm_jax.online.driver": ["drive"],
    "rmm_jax.online.run": ["Recorder", "run_online"],
    "rmm_jax.online.serve": ["call_keys", "call_batches", "serve_calls"],
}
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def run_examples(module):
    """Run every docstring example of `module` as a script would: no names but its own imports."""
    runner = doctest.DocTestRunner(optionflags=FLAGS, verbose=False)
    for test in doctest.DocTestFinder().find(module, globs={"__name__": "__main__"}):  # each gets a copy
        runner.run(test)
    return runner.summarize(verbose=False)


def test_every_documented_module_is_collected():
    assert set(DOCUMENTED) <= set(MODULES), sorted(set(DOCUMENTED) - set(MODULES))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = run_examples(module)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name} (output above)"
    if name in DOCUMENTED:
        assert result.attempted > 0, f"{name} has no runnable example"
        with_examples = {t.name.rsplit(".", 1)[-1] for t in doctest.DocTestFinder().find(module)
                         if t.examples}
        missing = sorted(set(DOCUMENTED[name]) - with_examples)
        assert not missing, f"no example in the docstring of {name}: {missing}"
