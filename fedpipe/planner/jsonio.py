"""JSON (de)serialisation of the planner's inputs and outputs, and a readable plan table.

Functions take and return JSON-shaped Python objects (dicts, lists, numbers,
strings); reading and writing files is the caller's business. The formats are
documented with examples in ``docs/planner.md``.

Units in JSON: FLOP/s, bytes, bytes/s and seconds, as in the dataclasses; for
convenience ``tflops``, ``memory_gb`` (1e9 bytes), ``gbps``/``mbps`` (bits/s)
and ``latency_ms`` are accepted too.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from ..wire.codecmodel import CodecSpeed
from .types import (ClusterView, DEFAULT_LINK, LayerProfile, Link, ModelProfile, NodeSpec, Plan,
                    ReplicaGroup, StagePlan, TrainConfig, reach)

JsonObject = dict[str, Any]
"""A JSON object as :func:`json.loads` gives it."""


class JsonFormatError(ValueError):
    """A JSON object does not follow the planner's format: the message says where and why."""


def _number(obj: JsonObject, keys: dict[str, float], where: str,
            default: float | None = None) -> float:
    """The value of the first of ``keys`` present, times its unit factor."""
    for key, factor in keys.items():
        if key in obj:
            value = obj[key]
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise JsonFormatError(f"{where}: {key!r} must be a number, got {value!r}")
            return float(value) * factor
    if default is None:
        raise JsonFormatError(f"{where}: needs one of {', '.join(map(repr, keys))}")
    return default


def link_from_json(obj: JsonObject, where: str = "link") -> Link:
    """A :class:`Link` from ``{"bandwidth"|"gbps"|"mbps": ..., "latency_s"|"latency_ms": ...}``.

    Raises:
        JsonFormatError: no bandwidth, a non-number, or a bandwidth <= 0.
    """
    if not isinstance(obj, dict):
        raise JsonFormatError(f"{where}: expected an object, got {obj!r}")
    bw = _number(obj, {"bandwidth": 1.0, "gbps": 1e9 / 8, "mbps": 1e6 / 8}, where)
    if bw <= 0:
        raise JsonFormatError(f"{where}: bandwidth must be > 0, got {bw} bytes/s")
    return Link(bw, _number(obj, {"latency_s": 1.0, "latency_ms": 1e-3}, where, 0.0))


def _link_json(link: Link) -> JsonObject:
    return {"bandwidth": link.bandwidth, "latency_s": link.latency}


def _pairs(entries: Any, where: str) -> dict[tuple[str, str], Link]:
    """Directed links from a list of ``{"from", "to", link..., "symmetric": true}``."""
    if not isinstance(entries, list):
        raise JsonFormatError(f"{where}: expected a list")
    out: dict[tuple[str, str], Link] = {}
    for i, e in enumerate(entries):
        here = f"{where}[{i}]"
        if not isinstance(e, dict) or "from" not in e or "to" not in e:
            raise JsonFormatError(f"{here}: needs 'from' and 'to'")
        lk = link_from_json(e, here)
        a, b = str(e["from"]), str(e["to"])
        out[(a, b)] = lk
        if e.get("symmetric", True):
            out[(b, a)] = lk
    return out


def cluster_from_json(obj: JsonObject) -> ClusterView:
    """A :class:`ClusterView` from its JSON form (see ``docs/planner.md``).

    Keys: ``nodes`` (list of ``{"id", "flops"|"tflops", "memory_bytes"|"memory_gb",
    "name", "device", "site", "relay", "codec_speeds", "count"}``, ``codec_speeds`` a list of
    :class:`~fedpipe.wire.codecmodel.CodecSpeed`'s fields by name; with ``count`` n the
    entry stands for n nodes whose ids replace ``{i}`` in ``id`` by 0..n-1, or append ``-i``),
    ``default_link``, ``sites`` (``{site: intra-site link}``), ``site_links``
    and ``links`` (lists of ``{"from", "to", link..., "symmetric"}``;
    symmetric defaults to true; later entries override earlier ones).

    Raises:
        JsonFormatError: a missing or malformed field, or a repeated node id.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("nodes"), list):
        raise JsonFormatError("cluster: needs a 'nodes' list")
    nodes: list[NodeSpec] = []
    for i, e in enumerate(obj["nodes"]):
        where = f"nodes[{i}]"
        if not isinstance(e, dict) or "id" not in e:
            raise JsonFormatError(f"{where}: needs an 'id'")
        flops = _number(e, {"flops": 1.0, "tflops": 1e12}, where)
        memory = int(_number(e, {"memory_bytes": 1.0, "memory_gb": 1e9}, where))
        count = int(e.get("count", 1))
        for k in range(count):
            node_id = str(e["id"])
            if count > 1:
                node_id = node_id.replace("{i}", str(k)) if "{i}" in node_id else f"{node_id}-{k}"
            name = str(e.get("name", node_id))
            if count > 1 and "name" in e:
                name = name.replace("{i}", str(k)) if "{i}" in name else f"{name}-{k}"
            nodes.append(NodeSpec(node_id, flops, memory, name, str(e.get("device", "cpu")),
                                  str(e.get("site", "")), relay=str(e.get("relay", "")),
                                  codec_speeds=_speeds(e.get("codec_speeds", []), where)))
    ids = [n.node_id for n in nodes]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise JsonFormatError(f"cluster: node ids repeat: {dup}")
    default = (link_from_json(obj["default_link"], "default_link") if "default_link" in obj
               else DEFAULT_LINK)
    site_links = {(str(s), str(s)): link_from_json(lk, f"sites[{s!r}]")
                  for s, lk in obj.get("sites", {}).items()}
    site_links.update(_pairs(obj.get("site_links", []), "site_links"))
    return ClusterView(nodes, _pairs(obj.get("links", []), "links"), default, site_links)


def _speeds(entries: Any, where: str) -> tuple[CodecSpeed, ...]:
    """A node's ``codec_speeds`` from JSON: a list of objects with every field of
    :class:`~fedpipe.wire.codecmodel.CodecSpeed`."""
    fields = [f.name for f in dataclasses.fields(CodecSpeed)]
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and set(e) == set(fields) for e in entries):
        raise JsonFormatError(f"{where}.codec_speeds: needs a list of objects with exactly "
                              f"the keys {fields}")
    try:
        speeds = tuple(CodecSpeed(str(e["codec"]), *(float(e[k]) for k in fields[1:]))
                       for e in entries)
        for speed in speeds:
            speed.check()
        return speeds
    except (TypeError, ValueError) as e:
        raise JsonFormatError(f"{where}.codec_speeds: {e}") from None


def cluster_to_json(cluster: ClusterView) -> JsonObject:
    """The JSON form of a cluster (every link listed one way, bytes/s and seconds)."""
    def pairs(links: dict[tuple[str, str], Link]) -> list[JsonObject]:
        return [{"from": a, "to": b, **_link_json(lk), "symmetric": False}
                for (a, b), lk in links.items()]

    nodes = [{"id": n.node_id, "name": n.name, "flops": n.flops, "memory_bytes": n.memory_bytes,
              "device": n.device, **({"site": n.site} if n.site else {}),
              **({"relay": n.relay} if n.relay else {}),
              **({"codec_speeds": [dataclasses.asdict(s) for s in n.codec_speeds]}
                 if n.codec_speeds else {})} for n in cluster.nodes]
    return {"nodes": nodes, "default_link": _link_json(cluster.default_link),
            "site_links": pairs(cluster.site_links), "links": pairs(cluster.links)}


def profile_from_json(obj: JsonObject) -> ModelProfile:
    """A :class:`ModelProfile` from ``{"layers": [{"name", "flops", "activation_bytes",
    "parameter_bytes", "activation_width", "count"}], "input_bytes", "element_bytes"}``
    (``activation_width`` optional: 0, unknown).

    ``flops`` is forward + backward FLOP per sample; an entry with ``count`` n
    stands for n equal layers named ``name.0`` .. ``name.(n-1)``.

    Raises:
        JsonFormatError: a missing or malformed field.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("layers"), list):
        raise JsonFormatError("profile: needs a 'layers' list")
    layers = []
    for i, e in enumerate(obj["layers"]):
        where = f"layers[{i}]"
        if not isinstance(e, dict):
            raise JsonFormatError(f"{where}: expected an object")
        flops = _number(e, {"flops": 1.0}, where)
        act = int(_number(e, {"activation_bytes": 1.0}, where))
        par = int(_number(e, {"parameter_bytes": 1.0}, where, 0.0))
        count = int(e.get("count", 1))
        name = str(e.get("name", f"layer{i}"))
        width = int(_number(e, {"activation_width": 1.0}, where, 0.0))
        for k in range(count):
            layers.append(LayerProfile(f"{name}.{k}" if count > 1 else name, flops, act, par,
                                       width))
    return ModelProfile(layers, int(obj.get("input_bytes", 0)), int(obj.get("element_bytes", 4)))


def profile_to_json(profile: ModelProfile) -> JsonObject:
    """The JSON form of a profile (one entry per layer)."""
    return {"input_bytes": profile.input_bytes, "element_bytes": profile.element_bytes,
            "layers": [{"name": la.name, "flops": la.flops, "activation_bytes": la.activation_bytes,
                        "parameter_bytes": la.parameter_bytes,
                        "activation_width": la.activation_width} for la in profile.layers]}


_CONFIG_KEYS = ("batch_size", "microbatches", "schedule", "max_staleness", "state_factor",
                "stages", "cuts", "replicas", "compression", "activation_compression",
                "gradient_compression", "sync_every", "recompute", "precision")


def config_from_json(obj: JsonObject) -> TrainConfig:
    """A :class:`TrainConfig` from an object with its field names as keys.

    Raises:
        JsonFormatError: no ``batch_size``, or an unknown key.
    """
    if not isinstance(obj, dict) or "batch_size" not in obj:
        raise JsonFormatError("config: needs 'batch_size'")
    unknown = sorted(set(obj) - set(_CONFIG_KEYS))
    if unknown:
        raise JsonFormatError(f"config: unknown key(s) {unknown}; known: {list(_CONFIG_KEYS)}")
    if "cuts" in obj:  # a JSON array
        obj = {**obj, "cuts": tuple(obj["cuts"])}
    return TrainConfig(**obj)


def config_to_json(config: TrainConfig) -> JsonObject:
    """The JSON form of a config."""
    return {k: list(v) if isinstance(v, tuple) else v
            for k in _CONFIG_KEYS if (v := getattr(config, k)) is not None}


def plan_to_json(plan: Plan) -> JsonObject:
    """The JSON form of a plan: its fields, groups and stages as nested objects."""
    return {
        "predicted_step_seconds": plan.predicted_step_seconds,
        "predicted_samples_per_second": plan.predicted_samples_per_second,
        "sync_seconds": plan.sync_seconds,
        "schedule": plan.schedule,
        "unused": list(plan.unused),
        "groups": [{"microbatches": g.microbatches, "samples": g.samples,
                    "predicted_seconds": g.predicted_seconds,
                    "stages": [{"node_id": s.node_id, "layer_start": s.layer_start,
                                "layer_end": s.layer_end, "activation_codec": s.activation_codec,
                                "gradient_codec": s.gradient_codec, "recompute": s.recompute}
                               for s in g.stages]}
                   for g in plan.groups],
    }


def plan_from_json(obj: JsonObject) -> Plan:
    """The :class:`Plan` of :func:`plan_to_json`'s output.

    Raises:
        JsonFormatError: a missing field.
    """
    try:
        groups = [ReplicaGroup([StagePlan(**s) for s in g["stages"]],
                               g.get("microbatches", 0), g.get("samples", 0),
                               g.get("predicted_seconds", 0.0)) for g in obj["groups"]]
        return Plan(groups, obj["predicted_step_seconds"], list(obj.get("unused", [])),
                    obj.get("predicted_samples_per_second", 0.0), obj.get("sync_seconds", 0.0),
                    obj.get("schedule", ""))
    except (KeyError, TypeError) as e:
        raise JsonFormatError(f"plan: {e}") from None


def _without(row: tuple[str, ...], column: int) -> tuple[str, ...]:
    return row[:column] + row[column + 1:]


def format_plan(plan: Plan, cluster: ClusterView, profile: ModelProfile,
                config: TrainConfig) -> str:
    """A readable table of the plan: group, stage, node, how peers reach it when any
    stage's node is outbound-only (:func:`~fedpipe.planner.types.reach`, as ``fedpipe
    status`` says it), layers, codecs with the bytes each sends per microbatch on its link
    (a lowrank basis amortised over the messages between two,
    :meth:`~fedpipe.planner.codecs.CodecCost.wire_bytes`) and their encode + decode CPU
    time per microbatch (with the nodes' measured codec costs,
    :func:`fedpipe.planner.costs.transfer_seconds`), predicted times, and the predicted T
    (the step time × the steps factor of the plan's codecs,
    :func:`fedpipe.planner.codecs.steps_factor`)."""
    from .codecs import codec_cost, steps_factor
    from .costs import boundary_bytes, boundary_element_bytes, boundary_width

    nodes = {n.node_id: n for n in cluster.nodes}
    header: tuple[str, ...] = (
        "group", "stage", "node", "reach", "site", "TFLOP/s", "layers", "activations",
        "act B/mb", "act cpu/mb", "gradients", "grad B/mb", "grad cpu/mb")
    rows: list[tuple[str, ...]] = []
    used = []
    for gi, g in enumerate(plan.groups):
        per_mb = g.samples / g.microbatches if g.microbatches else 0.0

        def wire(codec: str, end: int, messages: int, per_mb: float = per_mb) -> str:
            used.append(codec)
            return _bytes(codec_cost(codec).wire_bytes(
                boundary_bytes(profile, end, per_mb, config.precision),
                boundary_element_bytes(profile, config.precision), boundary_width(profile, end),
                messages))

        def cpu(codec: str, end: int, sender: str, receiver: str, per_mb: float = per_mb) -> str:
            ends = [nodes[i].codec_speeds if i in nodes else () for i in (sender, receiver)]
            seconds = codec_cost(codec).seconds(
                boundary_bytes(profile, end, per_mb, config.precision), *ends)
            return f"{seconds * 1e3:.2f} ms"
        for si, s in enumerate(g.stages):
            n = nodes.get(s.node_id)
            last = si == len(g.stages) - 1
            rows.append((str(gi), str(si), (n.name or n.node_id) if n else s.node_id,
                         reach(n.relay if n else ""), n.site if n else "",
                         f"{n.flops / 1e12:.3g}" if n else "?",
                         f"{s.layer_start}-{s.layer_end - 1}",
                         "-" if last else s.activation_codec,
                         "-" if last else wire(s.activation_codec, s.layer_end, g.microbatches),
                         "-" if last else cpu(s.activation_codec, s.layer_end, s.node_id,
                                              g.stages[si + 1].node_id),
                         "-" if si == 0 else s.gradient_codec,
                         "-" if si == 0 else wire(s.gradient_codec, s.layer_start, 0),
                         "-" if si == 0 else cpu(s.gradient_codec, s.layer_start, s.node_id,
                                                 g.stages[si - 1].node_id)))
    staged = {s.node_id for g in plan.groups for s in g.stages}
    if not any(n.relay for n in cluster.nodes if n.node_id in staged):  # all direct: no column
        header, rows = _without(header, 3), [_without(r, 3) for r in rows]
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]
    line = "  ".join
    schedule = plan.schedule or config.schedule
    if schedule == "async":
        schedule += f" (max_staleness {config.max_staleness})"
    out = [f"plan: {len(plan.groups)} replica group(s) of a {len(profile.layers)}-layer model, "
           f"batch {config.batch_size} in {config.microbatches} "
           f"microbatch{'es' if config.microbatches != 1 else ''}, "
           f"schedule {schedule}, precision {config.precision}, "
           f"recompute {_recomputed(plan, config.recompute)}",
           line(h.ljust(w) for h, w in zip(header, widths)),
           line("-" * w for w in widths)]
    out += [line(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    out.append("")
    for gi, g in enumerate(plan.groups):
        out.append(f"group {gi}: {g.microbatches} microbatches, {g.samples} samples, "
                   f"{g.predicted_seconds:.3f} s forward+backward")
    if len(plan.groups) > 1:
        out.append(f"syncing the groups adds {plan.sync_seconds:.3f} s per step")
    out.append(f"predicted step: {plan.predicted_step_seconds:.3f} s, "
               f"{_rate(plan.predicted_samples_per_second)} samples/s")
    factor = steps_factor(used)
    out.append(f"predicted T: {factor:.2f} x the steps of raw fp32 (the codecs' measured "
               f"factor) x {plan.predicted_step_seconds:.3f} s = "
               f"{factor * plan.predicted_step_seconds:.3f} s per raw fp32 step to a target"
               f"{_factor_note(used)}")
    if plan.unused:
        names = [nodes[i].name or i if i in nodes else i for i in plan.unused]
        shown = ", ".join(names[:12]) + (f", ... ({len(names)} in all)" if len(names) > 12 else "")
        out.append(f"unused: {shown}")
    return "\n".join(out)


def _rate(per_second: float) -> str:
    """A rate for the plan table: one decimal, or three significant digits below 1 (a
    big model on small nodes plans 0.0064 samples/s, not 0.0)."""
    return f"{per_second:.1f}" if per_second >= 1 else f"{per_second:.3g}"


def _recomputed(plan: Plan, mode: str) -> str:
    """Activation recomputation as the plan table says it: ``mode``, and under "auto" the
    stages the planner turned it on for (``StagePlan.recompute``)."""
    if mode != "auto":
        return mode
    on = [f"{gi}/{si}" for gi, g in enumerate(plan.groups) for si, s in enumerate(g.stages)
          if s.recompute]
    return f"auto (on at group/stage {', '.join(on)})" if on else "auto (on at no stage)"


def _factor_note(specs: list[str]) -> str:
    """What the plan table adds to its predicted T about codecs ``specs``' factors: those
    never measured (taken as 1) and those whose measured run never reached the target
    (a lower bound), :data:`fedpipe.wire.codecmodel.STEPS_MEASURED`; "" for none."""
    from ..spec import parse_codec
    from ..wire import codecmodel

    names = sorted({parse_codec(s).name for s in specs} - {"raw"})
    unmeasured = [n for n in names if n not in codecmodel.STEPS_MEASURED]
    bound = [n for n in names if n in codecmodel.STEPS_LOWER_BOUND]
    notes = ([f"{', '.join(unmeasured)} not measured, taken as 1"] if unmeasured else []) + (
        [f"{', '.join(bound)} never reached the target: a lower bound"] if bound else [])
    return f" ({'; '.join(notes)})" if notes else ""


def _bytes(n: float) -> str:
    """``n`` bytes, readable: "512 B", "1.5 kB", "3.2 MB"."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
