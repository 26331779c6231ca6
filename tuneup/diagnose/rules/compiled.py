"""torch.compile: graphs that recompile again and again, and graph breaks in the job's code."""

from __future__ import annotations

from ..rule import Evidence, Facts, rule

RECOMPILES_PER_SITE = 2  # dynamo's automatic dynamic shapes recompile once by design


@rule(
    id="recompiles",
    title="A compiled function keeps recompiling",
    severity="medium",
    inputs="torch.compile's recompiles per compiled function and the guard that failed "
           "(torch._dynamo.utils.guard_failures), compile time from dynamo's compile callbacks",
    threshold=f"one compiled function recompiled >= {RECOMPILES_PER_SITE} times",
    why="A graph is specialized to what its guards check (tensor sizes, Python values, module "
        "attributes); when a guard fails dynamo compiles again. Once is normal: a size that changes marks "
        "that dimension dynamic. More means something the graph depends on keeps changing, each time "
        "paying a compilation; past torch._dynamo.config.recompile_limit (8) the function runs eagerly.",
    doc="https://docs.pytorch.org/docs/stable/torch.compiler_troubleshooting.html",
)
def recompiles(facts: Facts) -> Evidence | None:
    compiled = facts.compiled
    sites = [site for site in compiled.get("recompile_sites") or [] if site.get("count", 0) >= RECOMPILES_PER_SITE]
    if not sites:
        return None
    site = sites[0]
    guard = str(site.get("guard", ""))
    totals = facts.totals
    spent, trained = totals.get("compile_seconds") or 0.0, totals.get("seconds") or 0.0
    compiles = max(1, compiled.get("compiles") or 1)
    # The recompilations' share of the run (compile time spread evenly over compilations).
    share = spent * min(1.0, compiled.get("recompiles", 0) / compiles) / (spent + trained) if spent + trained else 0.0
    if "size" in guard or "stride" in guard:
        fix = ("torch._dynamo.mark_dynamic(x, 0)   # before the first call: the batch dimension varies\n"
               "# or: DataLoader(..., drop_last=True) so the last batch is not short;\n"
               "# or: torch.compile(model, dynamic=True)")
    else:
        fix = ("# keep what the failed guard checks fixed between calls (a Python number, a flag,\n"
               "# a module attribute), or pass it as a tensor; TORCH_LOGS=recompiles shows every reason")
    return Evidence(
        observed=f"{site.get('where')} recompiled {site.get('count')} times ({compiled.get('recompiles')} recompiles "
                 f"in all), last because {guard}; compiling took {spent:.2f} s of the steps measured",
        numbers={"recompiles": compiled.get("recompiles"), "sites": sites, "compile_seconds": spent,
                 "compiles": compiled.get("compiles")},
        fix=fix,
        gain=share or None,
        gain_text=None if share else "the recompilations' time, and a function that stays compiled",
    )


@rule(
    id="graph-breaks",
    title="torch.compile breaks the graph in the job's code",
    severity="low",
    inputs="graph breaks with dynamo's reason and the job's source line (torch._dynamo.utils."
           "graph_break_reasons)",
    threshold=">= 1 graph break",
    why="At a graph break dynamo ends the graph, runs the rest of the Python eagerly and starts another "
        "graph after it: more guards to check each call, no fusion across the break, and for a host "
        "read (.item(), a data-dependent if) a wait for the device at every step.",
    doc="https://docs.pytorch.org/docs/stable/compile/programming_model.graph_breaks_index.html",
)
def graph_breaks(facts: Facts) -> Evidence | None:
    compiled = facts.compiled
    sites = compiled.get("graph_break_sites") or []
    if not compiled.get("graph_breaks") or not sites:
        return None
    named = "; ".join(f"{site.get('where')} ({site.get('reason')})" for site in sites[:3])
    reasons = " ".join(str(site.get("reason", "")) for site in sites).lower()
    if "item" in reasons:
        fix = ("x = torch.where(cond, a, b)    # decide on the device instead of `if t.item() ...`\n"
               "# or, to keep .item() inside the graph: torch._dynamo.config.capture_scalar_outputs = True")
    else:
        fix = ("# torch.compile(model, fullgraph=True) stops at each break with its reason;\n"
               "# move the unsupported call out of the compiled function or replace it with a torch op")
    return Evidence(
        observed=f"{compiled['graph_breaks']} graph break(s) while compiling: {named}",
        numbers={"graph_breaks": compiled["graph_breaks"], "sites": sites, "graphs": compiled.get("graphs")},
        fix=fix,
        gain_text="fewer, larger graphs: fusion across the break, fewer guard checks, no host wait there "
                  "(not measurable from step times alone)",
    )
