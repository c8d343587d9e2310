"""Codec CPU costs measured per node (issue 23): the start-up calibration, its trip through
a node's capabilities to the planner, and the planner pricing each link's codec with the
sending node's encode and the receiving node's decode."""
from __future__ import annotations

import math

import pytest

from fedpipe.node.probe import probe
from fedpipe.planner import (ClusterView, LayerProfile, Link, ModelProfile, NodeSpec,
                             SearchOptions, TrainConfig, jsonio, make_plan, simulate)
from fedpipe.planner.costs import transfer_seconds
from fedpipe.planner.protoio import cluster_view
from fedpipe.proto import node_pb2, tracker_pb2
from fedpipe.spec import parse_codec
from fedpipe.tracker.errors import InvalidArgument
from fedpipe.tracker.registration import MAX_CODEC_SPEEDS, validate_node
from fedpipe.wire import codecspeed
from fedpipe.wire.codecmodel import CodecSpeed, cpu_seconds, model

pytestmark = pytest.mark.timeout(120)


def test_calibration_gives_one_nonnegative_cost_per_codec_in_order():
    speeds = codecspeed.measure(("bf16", "int8", "int8+zstd:3", "int8:64+zstd"), reps=2)
    assert [s.codec for s in speeds] == ["bf16", "int8", "int8+zstd", "int8+zstd"]
    for s in speeds:
        figures = (s.encode_fixed, s.encode_per_byte, s.decode_fixed, s.decode_per_byte)
        assert all(math.isfinite(f) and f >= 0 for f in figures), s
    for s in speeds[1:]:  # quantizing, and zstd, cost more than raw's view of the tensor
        large = codecspeed.LARGE_BYTES
        assert s.encode_fixed + s.encode_per_byte * large > 0, s
        assert s.decode_fixed + s.decode_per_byte * large > 0, s


def test_the_codecs_a_job_may_name_for_a_link_are_measured_too():
    named = ("had4", "had2:64", "topk:0.05", "lowrank", "lowrank8:8@5")
    assert set(named) - set(codecspeed.CALIBRATED) == {"had2:64", "topk:0.05", "lowrank8:8@5"}
    speeds = codecspeed.measure(named, reps=2)  # lowrank: over a link holding its basis
    assert [s.codec for s in speeds] == ["had4", "had2", "topk", "lowrank", "lowrank8"]
    for s in speeds:
        figures = (s.encode_fixed, s.encode_per_byte, s.decode_fixed, s.decode_per_byte)
        assert all(math.isfinite(f) and f >= 0 for f in figures), s
    for s in speeds[:3]:  # a rotation each way, a top-k: well above raw's view of the tensor
        assert s.encode_fixed + s.encode_per_byte * codecspeed.LARGE_BYTES > 0, s


def test_the_calibration_fits_the_line_through_its_two_sizes():
    small, large = codecspeed.SMALL_BYTES, codecspeed.LARGE_BYTES
    fixed, per_byte = codecspeed._fit(1e-4 + 2e-9 * small, 1e-4 + 2e-9 * large)
    assert fixed == pytest.approx(1e-4) and per_byte == pytest.approx(2e-9)
    assert codecspeed._fit(3e-4, 1e-4) == (3e-4, 0.0)  # noise: never a negative slope
    x = codecspeed.relu_like(small)
    assert x.shape == (small // 1024, 256) and x.dtype.itemsize == 4
    assert (x >= 0).all() and 0.4 < (x == 0).float().mean() < 0.6


def test_a_nodes_codec_costs_reach_the_planner_through_its_capabilities():
    resources = probe("cpu")
    assert [s.codec for s in resources.codec_speeds] == [
        codecspeed_key(c) for c in codecspeed.CALIBRATED]
    info = tracker_pb2.NodeInfo(node_id="n0", name="n0", address="127.0.0.1:7000", alive=True,
                                resources=resources)
    wire = tracker_pb2.NodeInfo.FromString(info.SerializeToString())
    (node,) = cluster_view([wire], []).nodes
    assert node.codec_speeds == tuple(
        CodecSpeed(s.codec, s.encode_fixed, s.encode_per_byte, s.decode_fixed, s.decode_per_byte)
        for s in resources.codec_speeds)
    cluster = ClusterView([node])
    assert jsonio.cluster_from_json(jsonio.cluster_to_json(cluster)).nodes[0].codec_speeds \
        == node.codec_speeds
    validate_node(tracker_pb2.RegisterNodeRequest(address="127.0.0.1:7000",
                                                  resources=resources))


def codecspeed_key(spec: str) -> str:
    return "int8+zstd" if spec.startswith("int8") and "zstd" in spec else spec


@pytest.mark.parametrize("bad", [dict(encode_fixed=math.nan), dict(decode_per_byte=-1e-9),
                                 dict(encode_per_byte=1.0), dict(codec=""),
                                 dict(codec="x" * 65)])
def test_the_tracker_refuses_a_broken_codec_cost(bad):
    fields = dict(codec="int8", encode_fixed=1e-5, encode_per_byte=1e-9, decode_fixed=1e-5,
                  decode_per_byte=1e-9) | bad
    resources = node_pb2.Resources(flops=1e9, memory_bytes=2**30,
                                   codec_speeds=[node_pb2.CodecSpeed(**fields)])
    request = tracker_pb2.RegisterNodeRequest(address="127.0.0.1:7000", resources=resources)
    with pytest.raises(InvalidArgument, match="codec speed"):
        validate_node(request)
    # a cluster file is held to the same rule (was: Infinity reached the planner, which
    # crashed converting it to an integer)
    node = dict(id="n0", flops=1e9, memory_bytes=2**30, codec_speeds=[fields])
    with pytest.raises(jsonio.JsonFormatError, match="codec_speeds: codec speed"):
        jsonio.cluster_from_json({"nodes": [node]})
    many = node_pb2.Resources(flops=1e9, memory_bytes=2**30, codec_speeds=[
        node_pb2.CodecSpeed(codec="int8")] * (MAX_CODEC_SPEEDS + 1))
    with pytest.raises(InvalidArgument, match="at most"):
        validate_node(tracker_pb2.RegisterNodeRequest(address="127.0.0.1:7000", resources=many))


def speeds(per_byte: float, fixed: float = 0.0, zstd_per_byte: float | None = None):
    """Every calibrated codec at ``fixed`` s per message and ``per_byte`` s per byte each way;
    int8+zstd at ``zstd_per_byte`` where given."""
    out = []
    for c in codecspeed.CALIBRATED:
        key = codecspeed_key(c)
        pb = zstd_per_byte if zstd_per_byte is not None and "zstd" in key else per_byte
        out.append(CodecSpeed(key, fixed, pb, fixed, pb))
    return tuple(out)


def test_the_sender_prices_the_encode_and_the_receiver_the_decode():
    spec = parse_codec("int8+zstd")
    fast = (CodecSpeed("int8+zstd", 1e-4, 1e-9, 2e-4, 3e-9),)
    slow = (CodecSpeed("int8+zstd", 1e-2, 1e-6, 2e-2, 3e-6),)
    n = 1e6
    assert cpu_seconds(spec, n, fast, slow) == pytest.approx(1e-4 + 1e-3 + 2e-2 + 3.0)
    assert cpu_seconds(spec, n, slow, fast) == pytest.approx(1e-2 + 1.0 + 2e-4 + 3e-3)
    table = model(spec).cpu_seconds_per_byte(spec) * n
    assert cpu_seconds(spec, n) == pytest.approx(table)
    assert cpu_seconds(spec, n, fast) == pytest.approx(1e-4 + 1e-3 + table / 2)
    assert cpu_seconds(parse_codec("raw"), n, slow, slow) == 0.0
    link = Link(1e6, 0.01)
    busy, lat = transfer_seconds(link, n, "int8+zstd", 4, 0.0, fast, slow)
    assert lat == 0.01
    assert busy == pytest.approx(cpu_seconds(spec, n, fast, slow) + 0.15 * n / 1e6)


def two_nodes(a: tuple[CodecSpeed, ...], b: tuple[CodecSpeed, ...], compression: str = "auto"):
    """A 2-stage plan over a 10 Mbit/s link of an 8-layer model whose boundary carries
    4 MB per sample (16 MB per microbatch), and its cluster."""
    nodes = [NodeSpec("a", 1e12, 10**12, codec_speeds=a),
             NodeSpec("b", 1e12, 10**12, codec_speeds=b)]
    cluster = ClusterView(nodes, default_link=Link(1.25e6, 0.02))
    prof = ModelProfile([LayerProfile(f"l{i}", 1e10, 4 * 10**6, 10**6) for i in range(8)])
    config = TrainConfig(batch_size=16, microbatches=4, stages=2, compression=compression)
    plan = make_plan(cluster, prof, config, SearchOptions(iterations=40, time_limit_s=10))
    return plan, cluster, prof, config


def codecs_of(plan) -> tuple[str, str]:
    first, second = plan.groups[0].stages
    return first.activation_codec, second.gradient_codec


def test_nodes_with_slow_zstd_get_a_codec_without_it_and_slow_codecs_get_raw():
    fast = speeds(1e-10)
    assert codecs_of(two_nodes(fast, fast)[0]) == ("int8+zstd", "int8+zstd")
    slow_zstd = speeds(1e-10, zstd_per_byte=1e-6)  # zstd at 1 MB/s: 16 s a microbatch
    assert codecs_of(two_nodes(slow_zstd, slow_zstd)[0]) == ("int8", "int8")
    # only the sender's encode and the receiver's decode count: one slow end slows both ways
    assert codecs_of(two_nodes(fast, slow_zstd)[0]) == ("int8", "int8")
    crawling = speeds(1e-5)  # every codec at 100 kB/s: slower than the 1.25 MB/s link
    assert codecs_of(two_nodes(crawling, crawling)[0]) == ("raw", "raw")


def test_the_predicted_step_and_the_plan_table_use_the_measured_costs():
    fast, slow = speeds(1e-10), speeds(1e-10, zstd_per_byte=1e-7)
    quick, cluster, prof, config = two_nodes(fast, fast, "int8+zstd")
    costly, slow_cluster, _, _ = two_nodes(slow, slow, "int8+zstd")
    # 4 microbatches × 2 ways × 16 MB × (1e-7 - 1e-10) × 2 ends more CPU on the slow nodes
    assert simulate(costly, slow_cluster, prof, config).step_seconds > \
        simulate(quick, cluster, prof, config).step_seconds + 4 * 2 * 1.6e7 * 1e-7
    table = jsonio.format_plan(costly, slow_cluster, prof, config)
    assert "act cpu/mb" in table and "3200.00 ms" in table  # 1.6e7 B × 1e-7 s/B × 2 ends


def test_nodes_with_like_codec_costs_share_their_links_costs_in_the_search():
    from fedpipe.planner.context import PlanContext

    like, unlike = speeds(1.0e-9, 1e-5), speeds(4e-9, 1e-5)
    nodes = [NodeSpec(f"n{i}", 1e12, 10**12, codec_speeds=sp)
             for i, sp in enumerate((like, speeds(1.1e-9, 1.1e-5), unlike))]
    prof = ModelProfile([LayerProfile(f"l{i}", 1e10, 4 * 10**6, 10**6) for i in range(4)])
    ctx = PlanContext(ClusterView(nodes, default_link=Link(1.25e6, 0.02)), prof,
                      TrainConfig(batch_size=16, microbatches=4))
    assert ctx.speed_kind[0] == ctx.speed_kind[1] != ctx.speed_kind[2]
    assert ctx.link_costs(0, 1) is ctx.link_costs(1, 0)
    assert ctx.link_costs(0, 2) is not ctx.link_costs(0, 1)
