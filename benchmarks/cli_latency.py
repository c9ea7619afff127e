"""What a user waits for at the command line: each verb of the README walkthrough, run
twice as separate processes from a cold compilation cache.

    python benchmarks/cli_latency.py --json benchmarks/results/cli_latency.json

The walkthrough (``examples/``, 12 users): ``embed`` the chat histories, ``replay`` day 1
(scope hybrid) and day 2, ``rerank`` the requests, ``evaluate`` day 3. For every verb, in
each repeat: a new, empty compilation cache (``JAX_COMPILATION_CACHE_DIR``), then the
verb's command once (**first**: compiles and fills the cache) and once more (**second**:
loads what the first compiled), each from the same inputs (the policies are put back as
the previous step of the walkthrough left them), so the two runs do the same work and
only the cache differs. The embedding cache is warm for both (an untimed run embeds every
text first): embedding is the embedding cache's business, not the compiler's. ``embed``
compiles nothing, so its ratio measures the floor; ``embed, embeddings too`` is the same
command with the embedding cache cold as well on the first run (a new, empty one each
repeat), as a new user's first ``embed`` meets it: it loads the model and embeds every text,
and the second run reads them back.
``rmm-jax version`` (importing JAX and starting its CPU backend, compiling nothing) is timed
beside them: the floor every command that uses JAX pays. Each verb loads only its own
modules, so ``embed`` (no JAX) starts below it; ``beyond_version_s`` is what a verb's second
run takes beyond that floor (median second run minus median ``version``), the part of a warm
command that rmm-jax itself can still shorten. ``warm_profile``: each verb once more on its
warm cache with Python's import timer on, its wall seconds split into imports (JAX's
among them) and the rest (the interpreter's start and the verb's own work).

Reported per verb: wall seconds of each run and the per-repeat ratio second / first,
median [min, max] over ``--repeats`` interleaved repeats, with the 1-minute load average
(``load.noisy``: some sample above 2.5, so the ratios are contended). Target: every
second run takes at most 0.5 times the first.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, HelpFormatter, LoadWatch, positive_int, rmm_jax_command, spread, write_result

TARGET = 0.5
# (name, arguments, exit codes that mean success, what must be reset before each run)
WALK = [
    ("embed", ["embed", "jsonl:examples/chat_history.jsonl", "--out", "stores/timed"], (0,), "timed_store"),
    ("embed, embeddings too", ["embed", "jsonl:examples/chat_history.jsonl", "--out", "stores/timed"], (0,),
     "cold_embeddings"),
    ("replay day 1", ["replay", "stores/mine", "--log", "examples/calls_day1.jsonl", "--policies", "policies",
                      "--scope", "hybrid"], (0,), "no_policies"),
    ("replay day 2", ["replay", "stores/mine", "--log", "examples/calls_day2.jsonl", "--policies", "policies"],
     (0,), "after_day1"),
    ("rerank", ["rerank", "stores/mine", "--policies", "policies", "--calls", "examples/requests_day2.jsonl",
                "--explore", "--out", "ranked.jsonl"], (0,), "after_day2"),
    ("evaluate", ["evaluate", "stores/mine", "--log", "examples/calls_day2.jsonl", "--policies", "policies"],
     (0, 3), "after_day2"),
]


def cache_tag(rep: int, name: str) -> str:
    """The name of a repeat's compilation cache for a verb (``jax-TAG``)."""
    return f"{rep}-{name.replace(' ', '_').replace(',', '')}"


class Walkthrough:
    """A scratch copy of the examples with the stores each step starts from."""

    def __init__(self, root: Path):
        self.root = root
        shutil.copytree(REPO / "examples", root / "examples", ignore=shutil.ignore_patterns("*.py"))
        self.env = {**os.environ, "RMM_JAX_CACHE": str(root / "embeddings"), "XDG_CACHE_HOME": str(root / "xdg"),
                    "HF_HUB_OFFLINE": "1"}
        self.env.pop("JAX_COMPILATION_CACHE_DIR", None)
        self.env.pop("RMM_JAX_COMPILE_CACHE", None)

    def run(self, args: list[str], ok=(0,), cache: Path | None = None, embeddings: Path | None = None) -> float:
        """Wall seconds of one ``rmm-jax`` process (``cache``: its compilation cache; None: off;
        ``embeddings``: its embedding cache, default the walkthrough's warm one)."""
        env = {**self.env, **({"JAX_COMPILATION_CACHE_DIR": str(cache)} if cache else {"RMM_JAX_COMPILE_CACHE": "0"}),
               **({"RMM_JAX_CACHE": str(embeddings)} if embeddings else {})}
        t = time.perf_counter()
        r = subprocess.run(rmm_jax_command() + args, cwd=self.root, env=env, capture_output=True, text=True)
        took = time.perf_counter() - t
        if r.returncode not in ok:
            sys.exit(f"error: rmm-jax {' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}")
        return took

    def profile(self, args: list[str], ok, cache: Path) -> dict:
        """One more warm run of ``args`` with Python's import timer on
        (``PYTHONPROFILEIMPORTTIME``): its wall seconds, the seconds its imports took, and of
        those JAX's (``import jax`` wherever it first happens; 0 when never imported)."""
        env = {**self.env, "JAX_COMPILATION_CACHE_DIR": str(cache), "PYTHONPROFILEIMPORTTIME": "1"}
        t = time.perf_counter()
        r = subprocess.run(rmm_jax_command() + args, cwd=self.root, env=env, capture_output=True, text=True)
        took = time.perf_counter() - t
        if r.returncode not in ok:
            sys.exit(f"error: rmm-jax {' '.join(args)} exited {r.returncode}:\n{r.stderr[-3000:]}")
        imports = jax = 0.0
        for line in r.stderr.splitlines():  # "import time: self_us | cumulative_us | <2 spaces a level>name"
            if not line.startswith("import time:"):
                continue
            _, cumulative, name = line.split("|")
            if not cumulative.strip().isdigit():     # the header
                continue
            seconds = int(cumulative) / 1e6
            if not name.startswith("  "):            # top level: nested imports are inside its cumulative
                imports += seconds
            if name.strip() == "jax":
                jax += seconds
        return {"wall_s": took, "imports_s": imports, "jax_import_s": jax, "rest_s": took - imports}

    def prepare(self) -> None:
        """Untimed, without a compilation cache: the store, every text embedded, the policies
        after day 1 and after day 2."""
        cmd = {name: args for name, args, *_ in WALK}
        self.run(cmd["embed"][:2] + ["--out", "stores/mine"])
        self.run(cmd["replay day 1"])
        shutil.copytree(self.root / "policies", self.root / "policies_day1")
        self.run(cmd["replay day 2"])
        shutil.copytree(self.root / "policies", self.root / "policies_day2")
        self.run(cmd["rerank"])                                # embeds the requests' texts

    def reset(self, state: str) -> None:
        """Put back what the verb starts from."""
        for p in ("stores/timed", "policies", "ranked.jsonl"):
            path = self.root / p
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
        if state == "after_day1":
            shutil.copytree(self.root / "policies_day1", self.root / "policies")
        elif state == "after_day2":
            shutil.copytree(self.root / "policies_day2", self.root / "policies")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--repeats", type=positive_int, default=3, help="interleaved repeats (median, min, max)")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="rmm-cli-latency-"))
    try:
        walk = Walkthrough(root)
        print("preparing the walkthrough (untimed) ...", file=sys.stderr, flush=True)
        walk.prepare()
        watch = LoadWatch()
        times = {name: {"first": [], "second": []} for name, *_ in WALK}
        floor = []
        for rep in range(args.repeats):
            order = WALK if rep % 2 == 0 else WALK[::-1]
            for name, cmd, ok, state in order:
                tag = cache_tag(rep, name)
                embeddings = root / f"embeddings-{tag}" if state == "cold_embeddings" else None
                for which in ("first", "second"):
                    walk.reset(state)
                    times[name][which].append(walk.run(cmd, ok, root / f"jax-{tag}", embeddings))
                print(f"repeat {rep} {name}: first {times[name]['first'][-1]:.2f} s, second "
                      f"{times[name]['second'][-1]:.2f} s (load {watch.sample():.2f})", file=sys.stderr, flush=True)
            floor.append(walk.run(["version"], cache=root / "jax-version"))
        # Where a warm run's time goes: each verb once more, on the cache its last repeat filled.
        profiles = {}
        for name, cmd, ok, state in WALK:
            walk.reset(state)
            profiles[name] = walk.profile(cmd, ok, root / f"jax-{cache_tag(args.repeats - 1, name)}")
        load = watch.result()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    verbs = {}
    for name, cmd, _, _ in WALK:
        t = times[name]
        verbs[name] = {"command": "rmm-jax " + " ".join(cmd), "first_s": spread(t["first"]),
                       "second_s": spread(t["second"]),
                       "second_over_first": spread([b / a for a, b in zip(t["first"], t["second"])]),
                       "beyond_version_s": spread(t["second"])["median"] - spread(floor)["median"],
                       "warm_profile": profiles[name]}
    targets = [{"name": f"{name}: second run / first run (median)", "value": v["second_over_first"]["median"],
                "target": f"<= {TARGET}", "pass": v["second_over_first"]["median"] <= TARGET}
               for name, v in verbs.items()]
    out = {"verbs": verbs, "version_s": spread(floor), "repeats": args.repeats, "load": load, "targets": targets}
    print(f"{'verb':<24}{'first s':>10}{'second s':>10}{'second/first':>24}{'beyond version s':>18}")
    for name, v in verbs.items():
        r = v["second_over_first"]
        print(f"{name:<24}{v['first_s']['median']:>10.2f}{v['second_s']['median']:>10.2f}"
              f"{r['median']:>10.2f} [{r['min']:.2f}, {r['max']:.2f}]{v['beyond_version_s']:>18.2f}")
    print(f"rmm-jax version (the JAX floor): {spread(floor)['median']:.2f} s; load {load['max']:.2f}"
          + (" (noisy)" if load["noisy"] else ""))
    print(f"{'one more warm run':<24}{'wall s':>10}{'imports s':>10}{'of which JAX':>14}{'the rest s':>12}")
    for name, v in verbs.items():
        w = v["warm_profile"]
        print(f"{name:<24}{w['wall_s']:>10.2f}{w['imports_s']:>10.2f}{w['jax_import_s']:>14.2f}{w['rest_s']:>12.2f}")
    for t in targets:
        print(f"  {'PASS' if t['pass'] else 'MISS'}  {t['name']}: {t['value']:.2f} (target {t['target']})")
    if args.json:
        write_result(args.json, out)
    return out


if __name__ == "__main__":
    main()
