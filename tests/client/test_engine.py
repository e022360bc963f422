"""A real transformers model through a real daemon: outputs bit-identical to DynamicCache."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from kvtier.bench.demo import DemoOptions, run_demo  # noqa: E402
from kvtier.bench.spawn import DaemonProcess  # noqa: E402
from kvtier.bench.workload import build_model  # noqa: E402
from kvtier.client.hf_cache import KVLayout, TieredCache  # noqa: E402
from kvtier.client.tier_client import RequestRejected  # noqa: E402


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model("tiny", seed=0)


@pytest.fixture
def engine(model, tmp_path):
    layout = KVLayout.from_config(model.config, 16)
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={layout.block_bytes * 24}", f"tiers.dram_bytes={layout.block_bytes * 4}",
                      f"tiers.nvme_bytes={layout.block_bytes * 64}")
    c = d.client(engine_id="test-engine")
    c.register(block_bytes=layout.block_bytes, block_tokens=16, layout=layout.describe())
    yield c, layout
    c.check()
    c.close()
    assert d.stop() == 0


def step_both(model, ids, ref, tiered):
    with torch.no_grad():
        a = model(input_ids=ids, cache=ref).logits
        tiered.feed_tokens(ids)
        b = model(input_ids=ids, cache=tiered).logits
    assert torch.equal(a, b)
    return a[:, -1].argmax(-1, keepdim=True)


def test_long_sequence_in_chunks(model, engine):
    client, layout = engine
    ref, tc = DynamicCache(config=model.config), TieredCache(client, layout)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):  # chunked prefill of 4 x 48 tokens, crossing block boundaries unevenly
        nxt = step_both(model, torch.randint(0, 512, (1, 48), generator=g), ref, tc)
    for _ in range(40):
        nxt = step_both(model, nxt, ref, tc)
    assert tc.length == 4 * 48 + 40 and len(tc.rows[0].keys) == (4 * 48 + 40) // 16
    tc.close()


def test_batch_of_sequences(model, engine):
    client, layout = engine
    ids = torch.randint(0, 512, (3, 21), generator=torch.Generator().manual_seed(2))
    ref, tc = DynamicCache(config=model.config), TieredCache(client, layout, batch_size=3)
    nxt = step_both(model, ids, ref, tc)
    for _ in range(20):
        nxt = step_both(model, nxt, ref, tc)
    tc.close()


def test_batch_rows_sharing_a_prompt_hold_and_give_back_their_shared_blocks(model, engine):
    client, layout = engine
    row = torch.randint(0, 512, (1, 21), generator=torch.Generator().manual_seed(2))
    ref, tc = DynamicCache(config=model.config), TieredCache(client, layout, batch_size=2)
    nxt = step_both(model, torch.cat([row, row]), ref, tc)  # one prompt twice: the rows' first blocks fold
    assert tc.rows[0].blocks[0] == tc.rows[1].blocks[0]
    tc.deactivate()  # a pin per row, released per row
    tc.activate()
    for _ in range(3):
        nxt = step_both(model, nxt, ref, tc)
    tc.close()
    (me,) = [e for e in client.stats()["engines"] if e["engine"] == client.engine_id]
    assert me["live_blocks"] == 0 and me["pins"] == 0


@pytest.mark.parametrize("sample", [False, True])
def test_generate(model, engine, sample):
    client, layout = engine
    ids = torch.randint(0, 512, (2, 19), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=20, do_sample=sample, output_logits=True, return_dict_in_generate=True,
              attention_mask=torch.ones_like(ids), pad_token_id=0)
    torch.manual_seed(7)
    a = model.generate(ids, cache=DynamicCache(config=model.config), **kw)
    tc = TieredCache(client, layout, batch_size=2)
    torch.manual_seed(7)
    b = model.generate(ids, cache=tc, **kw)
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))
    tc.close()


def test_idle_sequence_comes_back_exact_after_demotion(model, engine):
    client, layout = engine
    g = torch.Generator().manual_seed(4)
    ref, tc = DynamicCache(config=model.config), TieredCache(client, layout)
    nxt = step_both(model, torch.randint(0, 512, (1, 100), generator=g), ref, tc)
    tc.deactivate()
    others = []
    for _ in range(3):  # other sequences push the idle one out of HBM
        o = TieredCache(client, layout)
        step_both(model, torch.randint(0, 512, (1, 100), generator=g), DynamicCache(config=model.config), o)
        o.deactivate()
        others.append(o)
    moved = client.stats()["paths"]
    assert moved["hbm->dram"]["moves"] + moved.get("hbm->nvme", {}).get("moves", 0) > 0
    for _ in range(10):
        nxt = step_both(model, nxt, ref, tc)
    assert client.stats()["service"]["hits_dram"] + client.stats()["service"]["hits_nvme"] > 0
    for o in others + [tc]:
        o.close()


def test_multi_turn_sessions_share_the_system_prompt():
    r = run_demo(DemoOptions(sessions=4, turns=2, user_tokens=24, gen_tokens=24))
    assert r["bit_exact"] and r["turns_checked"] == 8
    svc_hits = sum(row["hits"] for row in r["tiers"])
    assert svc_hits > 0
    assert r["segments"]["system"] == 4  # the shared system prompt: 64 tokens, 4 blocks, stored once
    assert r["segments"]["user"] > 0 and r["segments"]["assistant"] > 0
    assert 0 < r["importance_mean"] <= 1  # attention telemetry reached the daemon


def test_tiny_budget_pushes_idle_sessions_to_nvme():
    r = run_demo(DemoOptions(sessions=6, turns=2, user_tokens=24, gen_tokens=8, budget=0.05, dram=False))
    assert r["bit_exact"]
    assert r["paths"]["hbm->nvme"]["moves"] > 0 and r["paths"]["nvme->hbm"]["moves"] > 0


def test_slow_nvme_is_still_exact():
    r = run_demo(DemoOptions(sessions=4, turns=2, user_tokens=24, gen_tokens=8, budget=0.05, dram=False,
                             io_backend="faulty"), env={"KVTIER_FAULTS": "delay_s=0.003"})
    assert r["bit_exact"] and r["paths"]["nvme->hbm"]["moves"] > 0


def test_failing_nvme_gives_a_clear_error_not_a_wrong_token():
    with pytest.raises(RequestRejected) as e:
        run_demo(DemoOptions(sessions=4, turns=2, user_tokens=24, gen_tokens=8, budget=0.05, dram=False,
                             io_backend="faulty"), env={"KVTIER_FAULTS": "fail_reads=100000,mode=eio"})
    assert e.value.code == "io_error" and "Input/output error" in e.value.message


def test_corrupted_nvme_copy_is_never_served(model, tmp_path):
    layout = KVLayout.from_config(model.config, 16)
    d = DaemonProcess(tmp_path, f"tiers.hbm_bytes={layout.block_bytes * 10}", "tiers.dram_bytes=0",
                      f"tiers.nvme_bytes={layout.block_bytes * 64}")
    try:
        c = d.client(engine_id="victim")
        c.register(block_bytes=layout.block_bytes, block_tokens=16)
        g = torch.Generator().manual_seed(5)
        ref, tc = DynamicCache(config=model.config), TieredCache(c, layout)
        nxt = step_both(model, torch.randint(0, 512, (1, 64), generator=g), ref, tc)
        tc.deactivate()
        o = TieredCache(c, layout)  # fills HBM: the idle sequence goes to NVMe (no DRAM tier)
        step_both(model, torch.randint(0, 512, (1, 120), generator=g), DynamicCache(config=model.config), o)
        o.deactivate()
        assert c.stats()["paths"]["hbm->nvme"]["moves"] >= 1
        stride = layout.block_bytes + (-layout.block_bytes) % 4096
        slab = d.nvme_dir / "slab-0000.kvt"
        with open(slab, "r+b") as f:  # flip one payload byte in every slot, on disk
            size = os.path.getsize(slab)
            for off in range(4096 + 17, size, 4096 + stride):
                f.seek(off)
                byte = f.read(1)
                f.seek(off)
                f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(RequestRejected) as e:
            with torch.no_grad():
                tc.feed_tokens(nxt)
                model(input_ids=nxt, cache=tc)
        assert e.value.code == "corrupt" and "checksum" in e.value.message
        c.check()
        o.close()
        c.close()
    finally:
        assert d.stop() == 0
