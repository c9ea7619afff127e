"""A deployment you can watch: LoCoMo users' sessions arrive by their dates, each day's
questions are served with exploration from the current policies, the generator's
citations are simulated on what was served, and a nightly replay learns; every step is
the CLI, run as a subprocess, as a team would run it.

    python benchmarks/deploy.py --json benchmarks/results/deploy.json --plot benchmarks/results/deploy.png
    python benchmarks/deploy.py --draw-tau 0.02 --json benchmarks/results/deploy_draw.json \
        --plot benchmarks/results/deploy_draw.png
    python benchmarks/deploy.py --draw-tau 0.01 --json benchmarks/results/deploy_draw_001.json \
        --plot benchmarks/results/deploy_draw_001.png
    python benchmarks/deploy.py --gate --paired-with benchmarks/results/deploy.json \
        --json benchmarks/results/deploy_gate.json --plot benchmarks/results/deploy_gate.png
    python benchmarks/deploy.py --preset anchored_calibrated --json benchmarks/results/deploy_anchored_calibrated.json \
        --plot benchmarks/results/deploy_anchored_calibrated.png

**Time.** The five LoCoMo conversations span different years; each is shifted so that its
first session falls on day 0 (five users who start on the same day), keeping the gaps
between its sessions. The deployment then runs one cycle per ``--period`` days of that
calendar (default 14; ``--period 1`` is literally day by day, about a hundred cycles);
a cycle is called a *day* below. A question is asked on the day its last evidence session
arrives: only then does the store hold everything that answers it (questions are LoCoMo's,
in LoCoMo's order within a user; each gets a ``call_id`` and the day's date as its
``timestamp``).

**A day.** (1) ``rmm-jax embed jsonl:DAY --into STORE`` appends the sessions dated that day
(``--out`` on the first day); the chat lines carry LoCoMo's turn ids and speakers, and no
question or gold. (2) ``rmm-jax rerank STORE --policies P --calls REQUESTS --explore``
serves the day's questions from the current policies (none on day 1: the retriever's own
scores). (3) The generator is simulated on what was served: the class-calibrated model
(``rmm_jax.data.citations.oracle``, the CLI's default) cites each shown memory by whether
LoCoMo's gold marks it useful; gold is used here, offline, and never enters the log.
(4) ``rmm-jax replay STORE --log LOG --policies P --json`` learns overnight (the CLI's
default preset and scope, or ``--preset``'s, which the first night records when it creates
P). (5) ``rmm-jax evaluate STORE --log LOG --policies P --json``: tomorrow's policy estimated
on today's log, with the verdict.
With ``--gate`` a night the verdict does not ship is undone (6): ``rmm-jax policies
rollback P``, so tomorrow is served by today's policies and the day's calls are never
learned; ``--paired-with FILE`` (a run without it) then reports the final Recall@5
difference, paired per question (``paired``: :func:`rmm_jax.online.stats.gain_interval`
over conversations and questions; one deployment, so no seed level).

**Reported per day.** Recall@5 against gold, measured offline from the served lines: the
serving policy's own top 5 (the deterministic top 5 of the logged logits, what ``rerank``
without ``--explore`` would show), the drawn selection that was shown, and the retriever's
top 5; the gold-free measures of the night's replay (cited-recall@5 against the
retriever's, cite rate); ``evaluate``'s SNIPS estimate of the cite rate of tomorrow's
policy on today's log, its 95% interval and verdict, beside the cite rate tomorrow's
serving realises (the mean over its calls of cited / shown).

**Done when.** (a) The deployment's final Recall@5 (the serving policy's top 5, over every
question asked) lies within the 95% interval of ``simulate`` over the same questions in
the same order: the same online loop (:func:`rmm_jax.run_online`, the preset the first
night recorded and the CLI's default scope, identity start) on streams of exactly the served
calls (same candidates, same order), citing with the same model, updating every batch instead of every night, over
``--seeds`` seeds; the interval is :func:`rmm_jax.online.stats.gain_interval` over seeds
and questions. (b) On most days (more than half of those where
``evaluate`` gives a SNIPS interval; it withholds one whose effective sample size is too
small, and those days are counted apart) the SNIPS interval covers tomorrow's realised
cite rate. Both are in ``targets``. Beside tomorrow's realised rate, each day also has the
truth on today's calls: the expected cite rate of tomorrow's policy on today's questions
(its exact logits from ``rerank``, Monte Carlo over its draws, times the citation model's
rates), which tells an estimator's error from the change of questions between days.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import tempfile
import time
from pathlib import Path

import _common
import jax
import numpy as np

import rmm_jax as rj
from rmm_jax.data import load_locomo
from rmm_jax.data.citation_log import validate_record
from rmm_jax.data.citations import oracle
from rmm_jax.data.embed import embed_texts
from rmm_jax.data.store import open_store
from rmm_jax.online.run import run_online
from rmm_jax.online.stats import gain_interval
from rmm_jax.online.streams import streams_from_log

M = 5
CITE_SEED = 20250712


def cli(args: list, work: Path) -> str:
    """Run one ``rmm-jax`` command in ``work``; its stdout (a failure ends the benchmark)."""
    return _common.run_cli(args, cwd=work, env={"HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"},
                           ok=(0, 3))           # evaluate exits 3 when it withholds an estimate


def session_date(stamp: str) -> dt.date:
    """``1:56 pm on 8 May, 2023`` -> 2023-05-08."""
    return dt.datetime.strptime(stamp.split(" on ")[1], "%d %B, %Y").date()


def schedule(dataset, period: int) -> list[dict]:
    """The deployment's days: per day, each user's sessions that arrive and questions asked
    (module docstring, "Time")."""
    days: dict[int, dict] = {}
    for u in dataset.users:
        first = session_date(u.sessions[0].timestamp)
        day_of = {}
        for n, s in enumerate(u.sessions):
            day_of[s.id] = (session_date(s.timestamp) - first).days // period
            days.setdefault(day_of[s.id], {"sessions": {}, "questions": {}})["sessions"].setdefault(u.id, []).append(s)
        turn_session = {t.id: s.id for s in u.sessions for t in s.turns}
        for q in u.queries:
            if not q.gold_turn_ids:
                continue
            d = max(day_of[turn_session[g]] for g in q.gold_turn_ids)
            days[d]["questions"].setdefault(u.id, []).append(q)
    return [{"day": d, **days[d]} for d in sorted(days)]


def chat_lines(sessions: dict) -> list[dict]:
    """The day's new sessions as ``jsonl:`` chat lines: LoCoMo's turn ids and speakers."""
    out = []
    for uid, ss in sessions.items():
        out.append({"user_id": uid, "sessions": [
            {"session_id": s.id, "timestamp": s.timestamp,
             "messages": [{"role": "user", "name": t.speaker, "id": t.id, "content": t.text.split(": ", 1)[1]}
                          for t in s.turns]} for s in ss]})
    return out


def requests(questions: dict, stamp: str) -> list[dict]:
    return [{"call_id": f"{uid}-{q.id}", "user_id": uid, "query": q.text, "timestamp": stamp}
            for uid, qs in questions.items() for q in qs]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def cite(served: list[dict], gold: dict, first: int) -> list[dict]:
    """The generator on what was served: the class-calibrated model on each call's shown
    memories (useful = LoCoMo gold); one key per call, folded from its position in the
    whole deployment. Returns the log: served lines with ``cited``, no gold."""
    is_gold = np.zeros((len(served), M), bool)
    filled = np.zeros((len(served), M), bool)
    for i, rec in enumerate(served):
        for j, mid in enumerate(rec["selected"]):
            is_gold[i, j], filled[i, j] = mid in gold[rec["call_id"]], True
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(CITE_SEED), i))(
        np.arange(first, first + len(served)))
    cited = np.asarray(jax.vmap(oracle())(keys, is_gold, filled))
    return [{**rec, "cited": [m for m, c in zip(rec["selected"], cited[i]) if c]} for i, rec in enumerate(served)]


def served_recall(served: list[dict], gold: dict) -> dict:
    """Per call, Recall@5 against gold of the policy's top 5 (the logits' deterministic
    top 5), of the drawn selection, and of the retriever's top 5."""
    out = {"policy": [], "served": [], "retriever": []}
    for rec in served:
        g = gold[rec["call_id"]]
        order = np.argsort(-np.asarray(rec["logits"]), kind="stable")[:M]
        ids = [rec["candidates"][i] if isinstance(rec["candidates"][i], str) else rec["candidates"][i]["id"]
               for i in order]
        for key, shown in (("policy", ids), ("served", rec["selected"]), ("retriever", rec["candidates"][:M])):
            out[key].append(_common.recall_at([i in g for i in shown], len(g)))
    return out


def simulate_interval(store_path: Path, logs: list[dict], gold: dict, setting, seeds: int) -> tuple[dict, list]:
    """``simulate`` over exactly the served calls in the same order (module docstring,
    "Done when"): per seed and call, prequential Recall@5, pooled in call order."""
    st = open_store(store_path)
    records = [validate_record({**r, "gold": sorted(gold[r["call_id"]])}) for r in logs]
    vectors = embed_texts(sorted({r.query_text for r in records}), st.model)
    streams = streams_from_log(st, records, setting.layout, "served calls", vectors)
    streams = [dataclasses.replace(s, selected=None, cited=None, logged_log_prob=None, has_logged=None, calls=None)
               for s in streams]
    program = rj.make_run(*setting, cite_fn=oracle())
    params = rj.init_reranker(jax.random.key(0), st.dim, setting.layout.kind, setting.layout.hidden)
    order = {}                              # the pooled order: every call in deployment order
    for i, r in enumerate(records):
        order.setdefault(r.user_id, []).append(i)
    per_seed = []
    for seed in range(seeds):
        res = run_online(streams, program, params, seed=seed, users_per_chunk=8)
        pooled = np.zeros(len(records))
        for s in streams:
            pooled[order[s.user_id]] = res.recall[s.user_id]
        per_seed.append(pooled)
    return gain_interval(np.stack(per_seed)), [float(p.mean()) for p in per_seed]


def cite_rate(log: list[dict]) -> float:
    return float(np.mean([len(r["cited"]) / len(r["selected"]) for r in log]))


def expected_cite_rate(lines: list[dict], gold: dict, draws: int = 4000, seed: int = 0) -> float:
    """The cite rate a policy would get in expectation on these calls, from its logged
    logits (served lines): each candidate's chance to be shown, by Monte Carlo over
    Gumbel top-5 draws (NumPy, independent of the code under test), times the citation
    model's chance to cite it (its rate for a useful memory if gold, else the other rate),
    over the 5 shown."""
    from rmm_jax.data.citations import P_OTHER, P_USEFUL
    rng = np.random.default_rng(seed)
    out = []
    for rec in lines:
        z = np.asarray(rec["logits"], np.float64)
        top = np.argsort(-(z + rng.gumbel(size=(draws, z.size))), axis=1)[:, :M]
        shown = np.bincount(top.ravel(), minlength=z.size) / draws
        ids = [c if isinstance(c, str) else c["id"] for c in rec["candidates"]]
        p = np.array([P_USEFUL if c in gold[rec["call_id"]] else P_OTHER for c in ids])
        out.append(float(shown @ p) / M)
    return float(np.mean(out))


ESTIMATORS = ("ips", "snips", "rips", "snrips", "iips")


def direction(days: list[dict], e: str = "snips") -> dict:
    """Which way the misses go: on how many days estimator ``e``'s estimate lies above the
    truth on today's calls and above tomorrow's realised rate (of the days it gives one), and
    on how many days tomorrow's realised rate lies below the truth on today's calls."""
    given = [d["ope"] for d in days if d["ope"][e]["value"] is not None]
    paired = [o for o in (d["ope"] for d in days) if o["tomorrow"] is not None]
    return {"estimator": e, "days_with_estimate": len(given),
            "above_truth_today": sum(o[e]["value"] > o["truth_today"] for o in given),
            "above_tomorrow": sum(o[e]["value"] > o["tomorrow"] for o in given if o["tomorrow"] is not None),
            "days_with_tomorrow": len(paired),
            "tomorrow_below_truth_today": sum(o["tomorrow"] < o["truth_today"] for o in paired)}


def coverage(days: list[dict], truth: str) -> dict:
    """Per estimator: on how many days its reliable interval covers ``truth`` (a key of each
    day's ``ope``), of the days where it gave one, and how many it withheld."""
    out = {}
    for e in ESTIMATORS:
        judged = [d["ope"][e] for d in days if d["ope"][truth] is not None]
        ok = [x for x in judged if x["ci95"] is not None]
        hit = [x["ci95"][0] <= d["ope"][truth] <= x["ci95"][1] for d in days for x in [d["ope"][e]]
               if d["ope"][truth] is not None and x["ci95"] is not None]
        out[e] = {"days": len(judged), "reliable": len(ok), "covered": int(sum(hit)),
                  "withheld": len(judged) - len(ok)}
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    days = [d for d in result["days"] if d["calls"]]
    x = [d["day"] for d in days]
    fig, axes = plt.subplots(3, 1, figsize=(8, 10), sharex=True)
    ax = axes[0]
    for key, style, label in (("policy", "-o", "serving policy's top 5"), ("served", ":.", "drawn and shown"),
                              ("retriever", "--", "retriever's top 5")):
        ax.plot(x, [d["recall@5"][key] for d in days], style, label=label, ms=4)
    sim, fin = result["final"]["simulate"], result["final"]["recall@5"]
    ax.axhspan(sim["lo"], sim["hi"], color="tab:green", alpha=0.15,
               label=f"simulate, same calls: 95% interval [{sim['lo']:.3f}, {sim['hi']:.3f}]")
    ax.axhline(fin, color="tab:blue", lw=0.8, label=f"deployment, all days: {fin:.3f}")
    ax.set_ylabel("Recall@5 (gold, offline)")
    ax.legend(fontsize=7, loc="lower right")
    ax = axes[1]
    ax.plot(x, [d["replay"]["cited_recall@5"] for d in days], "-o", ms=4, label="cited-recall@5, replay")
    ax.plot(x, [d["replay"]["base_cited_recall@5"] for d in days], "--", label="cited-recall@5, retriever")
    ax.plot(x, [d["replay"]["cite_rate"] for d in days], ":s", ms=4, label="cite rate")
    ax.set_ylabel("gold-free, night's replay")
    ax.legend(fontsize=7)
    ax, labelled = axes[2], set()
    for d in days:
        ope = d["ope"]
        for e, dx, colour in (("snips", 0.0, "tab:blue"), ("iips", 0.25, "tab:orange")):
            if ope[e]["ci95"] is not None:
                lo, hi = ope[e]["ci95"]
                ax.errorbar(d["day"] + dx, ope[e]["value"], yerr=[[ope[e]["value"] - lo], [hi - ope[e]["value"]]],
                            fmt="o", color=colour, ms=3, capsize=2, label=None if e in labelled else e)
                labelled.add(e)
        ax.plot(d["day"] + 0.12, ope["truth_today"], "gx", ms=6,
                label=None if "truth" in labelled else "truth on today's calls")
        labelled.add("truth")
        if ope["tomorrow"] is not None:
            ax.plot(d["day"] + 0.5, ope["tomorrow"], "k_", ms=9, mew=2,
                    label=None if "tomorrow" in labelled else "realised tomorrow")
            labelled.add("tomorrow")
    c = result["ope_coverage"]
    t, u = c["tomorrow"]["snips"], c["truth_today"]["snips"]
    ax.set_title(f"cite rate of tomorrow's policy, estimated on today's log (SNIPS: {t['withheld']} of {t['days']} "
                 f"days withheld);\nits interval covers tomorrow's realised rate on {t['covered']} of {t['reliable']} "
                 f"days, the truth on today's calls on {u['covered']} of {u['reliable']}", fontsize=8)
    ax.set_ylabel("cite rate")
    ax.legend(fontsize=7, ncol=4)
    ax.set_xlabel(f"day (one per {result['period_days']} days of the users' calendars)")
    ax.set_ylabel("cite rate")
    fig.suptitle(f"deployment on LoCoMo ({len(result['users'])} users, {result['calls']} calls): "
                 f"serve --explore, cite, replay nightly", fontsize=10)
    fig.tight_layout()
    _common.save_figure(fig, path, dpi=110)


def paired_with(result: dict, other_path: Path) -> dict:
    """``--paired-with``: this deployment's final Recall@5 minus another's (same calls, same
    order), paired per question, with its interval over conversations and questions. One
    deployment, no seeds or streams: the differences come from the two result files, straight
    into :func:`gain_interval` (what :func:`_common.paired_gain` does for per-seed runs)."""
    other = json.loads(other_path.read_text())
    mine, theirs = result["per_question"], other.get("per_question")
    if theirs is None or theirs["user"] != mine["user"]:
        raise SystemExit(f"--paired-with {other_path}: not the same deployment's calls (re-run it with this script)")
    diff = np.asarray(mine["recall@5"]) - np.asarray(theirs["recall@5"])
    return {"with": other_path.name, "with_commit": other["provenance"].get("commit"),
            "gain": gain_interval(diff, groups=np.asarray(mine["user"]))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_common.HelpFormatter)
    _common.add_data_option(ap)
    ap.add_argument("--period", type=_common.positive_int, default=14, help="calendar days per deployment day (cycle)")
    ap.add_argument("--seeds", type=_common.positive_int, default=5, help="simulate repeats for the interval")
    ap.add_argument("--work", type=Path, default=None, help="keep the stores, policies and logs here")
    ap.add_argument("--draw-tau", type=float, default=None,
                    help="draw the shown memories at this temperature (rerank --explore --tau, replay --draw-tau; "
                         "the store records it) instead of the default preset's tau")
    ap.add_argument("--preset", choices=sorted(set(rj.PRESETS) - {"paper"}), default=None,   # replay refuses paper
                    help="the first night's replay --preset (the store records it; later nights and simulate's "
                         "interval use it); default: the CLI's default preset")
    ap.add_argument("--gate", action="store_true",
                    help="roll back each night whose evaluate verdict is not to ship (rmm-jax policies rollback)")
    ap.add_argument("--paired-with", type=_common.existing_path, default=None,
                    help="a result file of the same deployment without --gate: the final Recall@5 difference, "
                         "paired per question")
    ap.add_argument("--json", type=Path, default=None, help="write the result here")
    ap.add_argument("--plot", type=Path, default=None, help="PNG of the days")
    ap.add_argument("--replot", action="store_true", help="only redraw --plot from --json")
    args = ap.parse_args(argv)
    if args.replot:
        plot(_common.replot_result(ap, args), args.plot)
        return 0
    dataset = load_locomo(_common.require_data(args.data))
    t0 = time.perf_counter()
    days = schedule(dataset, args.period)
    gold = {f"{u.id}-{q.id}": set(q.gold_turn_ids) for u in dataset.users for q in u.queries}
    work = Path(args.work or tempfile.mkdtemp(prefix="rmm-deploy-"))
    work.mkdir(parents=True, exist_ok=True)
    store, policies = work / "store", work / "policies"
    rows, logs, recall, n_calls = [], [], {"policy": [], "served": [], "retriever": []}, 0
    asked_by = []                                                               # each call's user, in order
    draw = () if args.draw_tau is None else ("--tau", args.draw_tau)          # rerank --explore's temperature
    learn = () if args.draw_tau is None else ("--draw-tau", args.draw_tau)    # what replay records
    for i, day in enumerate(days):
        d = day["day"]
        chats = write_jsonl(work / f"chats_{d:03d}.jsonl", chat_lines(day["sessions"]))
        cli(["embed", f"jsonl:{chats.name}", *(("--into", store) if store.exists() else ("--out", store)), "-q"],
            work)
        row = {"day": d, "sessions": sum(map(len, day["sessions"].values())),
               "questions": sum(map(len, day["questions"].values())), "calls": 0}
        rows.append(row)
        if not day["questions"]:
            continue
        stamp = (dt.date(2024, 1, 1) + dt.timedelta(days=d * args.period)).isoformat()
        req = write_jsonl(work / f"requests_{d:03d}.jsonl", requests(day["questions"], stamp))
        served_path = work / f"served_{d:03d}.jsonl"
        cli(["rerank", store, "--policies", policies, "--calls", req.name, "--explore", *draw, "--out",
             served_path.name], work)
        served = [json.loads(line) for line in served_path.read_text().splitlines()]
        log = cite(served, gold, n_calls)
        n_calls += len(log)
        log_path = write_jsonl(work / f"calls_{d:03d}.jsonl", log)
        logs += log
        rec = served_recall(served, gold)
        for k in recall:
            recall[k] += rec[k]
        asked_by += [r["user_id"] for r in served]
        first = () if args.preset is None or policies.exists() else ("--preset", args.preset)   # the store records it
        rep = json.loads(cli(["replay", store, "--log", log_path.name, "--policies", policies, *learn, *first,
                              "--json"], work))
        ope = json.loads(cli(["evaluate", store, "--log", log_path.name, "--policies", policies, "--json"], work))
        shipped = bool(ope["verdict"]["ship"])
        if args.gate and not shipped:          # not shipped: tomorrow is served by today's policies
            cli(["policies", "rollback", policies, "--json"], work)
        again = work / f"tomorrow_on_{d:03d}.jsonl"     # tomorrow's policy on today's calls: its logits
        cli(["rerank", store, "--policies", policies, "--calls", req.name, "--explore", *draw, "--out", again.name],
            work)
        est = ope["estimates"]["cite_rate"]
        online, base = rep["online"], rep["base"]
        row.update(calls=len(log), realised_cite_rate=cite_rate(log),
                   **{"recall@5": {k: float(np.mean(v)) for k, v in rec.items()}},
                   replay={"cited_recall@5": online.get("cited_recall@5"), "cite_rate": online.get("cite_rate"),
                           "base_cited_recall@5": base.get("cited_recall@5"), "calls_cited": online.get("calls_cited")},
                   ope={**{e: {k: est[e].get(k) for k in ("value", "ci95", "ess", "reliable", "gain")}
                           for e in ESTIMATORS},
                        "logged": est["logged"]["value"], "verdict": ope.get("verdict"),
                        "truth_today": expected_cite_rate([json.loads(x) for x in again.read_text().splitlines()],
                                                          gold),
                        "tomorrow": None},
                   rolled_back=bool(args.gate and not shipped),
                   config={**rep["config"], "preset": rep["setting"]["preset"]} if i == 0 else None)
        print(f"day {d}: {len(log)} calls, Recall@5 policy {row['recall@5']['policy']:.3f} "
              f"(retriever {row['recall@5']['retriever']:.3f}), cite rate {row['realised_cite_rate']:.3f}; "
              f"tomorrow's policy on today's calls: SNIPS {est['snips'].get('value')}, "
              f"truth {row['ope']['truth_today']:.3f}", file=sys.stderr, flush=True)
    served_days = [r for r in rows if r["calls"]]
    for today, tomorrow in zip(served_days, served_days[1:]):
        today["ope"]["tomorrow"] = tomorrow["realised_cite_rate"]
    config = next(r["config"] for r in served_days if r.get("config"))
    for r in served_days:
        r.pop("config", None)
    lay = config["layout"]
    drawn = {"draw_tau": config["estimator"]["draw_tau"]} if config["estimator"].get("draw_tau") else {}
    setting = rj.preset(config["preset"], k=lay["k"], m=lay["m"], kind=lay["kind"], scope=lay["scope"],
                        rank=lay["rank"], **drawn)
    sim, per_seed = simulate_interval(store, logs, gold, setting, args.seeds)
    final = float(np.mean(recall["policy"]))
    cov = {"tomorrow": coverage(served_days, "tomorrow"), "truth_today": coverage(served_days, "truth_today")}
    snips = cov["tomorrow"]["snips"]
    result = {
        "dataset": "locomo", "users": [u.id for u in dataset.users], "period_days": args.period, "k": 20, "m": M,
        "config": config, "calls": n_calls, "days": rows,
        "final": {"recall@5": final, "recall@5_served": float(np.mean(recall["served"])),
                  "recall@5_retriever": float(np.mean(recall["retriever"])),
                  "simulate": {**sim, "per_seed": per_seed}, "within": bool(sim["lo"] <= final <= sim["hi"])},
        "per_question": {"recall@5": recall["policy"], "user": asked_by}, "gate": args.gate,
        "nights_rolled_back": sum(bool(r.get("rolled_back")) for r in served_days),
        "ope_coverage": cov, "ope_direction": direction(served_days),
        "targets": {"final_recall_within_simulate": bool(sim["lo"] <= final <= sim["hi"]),
                    "snips_covers_tomorrow_on_most_days": bool(snips["covered"] > snips["reliable"] / 2)},
        "seconds": round(time.perf_counter() - t0, 1),
    }
    if args.paired_with is not None:
        result["paired"] = paired_with(result, args.paired_with)
    if args.json:
        _common.write_result(args.json, result)
    if args.plot:
        plot(result, args.plot)
    print(f"final Recall@5 {final:.4f}; simulate [{sim['lo']:.4f}, {sim['hi']:.4f}]; SNIPS covers tomorrow on "
          f"{snips['covered']} of {snips['reliable']} days with an interval ({snips['withheld']} of {snips['days']} "
          "withheld)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
