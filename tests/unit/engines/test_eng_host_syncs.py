"""Host reads per micro-batch stall a GPU's queue (each one a device synchronization). The FSDP
engine's metric reduction sums its records where they are and reads the host once; Megatron's route
replay keeps its agreement counts on the device. Counted on CPU by spying on the tensor methods that
read a value to the host (float(), item(), cpu())."""
import pytest
import torch


@pytest.fixture
def host_reads(monkeypatch):
    count = {"n": 0}
    for name in ("__float__", "item", "cpu"):
        real = getattr(torch.Tensor, name)

        def spy(self, *a, _real=real, **k):
            count["n"] += 1
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, spy)
    return count


def test_fsdp_metric_reduction_reads_the_host_once(one_rank_world, host_reads):
    from verl_hpc.engines.fsdp.engine import FsdpEngine

    def records(n):
        return [{"loss": torch.tensor(0.5 * i), "tokens": torch.tensor(float(i + 1)), "kl": torch.tensor(0.1 * i),
                 **({"clip": torch.tensor(1.0)} if i % 2 else {})} for i in range(n)]

    FsdpEngine._reduce_metrics(None, records(2))
    few, host_reads["n"] = host_reads["n"], 0
    out = FsdpEngine._reduce_metrics(None, records(8))
    # what reads the host is the collectives' own (the key exchange), never a record or a metric
    assert host_reads["n"] == few
    tokens = sum(i + 1 for i in range(8))
    assert out["loss"] == pytest.approx(sum(0.5 * i for i in range(8)))
    assert out["tokens"] == tokens
    assert out["kl"] == pytest.approx(sum(0.1 * i * (i + 1) for i in range(8)) / tokens)
    assert out["clip"] == pytest.approx(sum(i + 1 for i in range(8) if i % 2) / tokens)


def test_route_replay_counts_on_the_device_per_micro_batch(host_reads):
    """Megatron's routing replay after each micro-batch: its agreement counts and recorded routes
    stay where the router ran (no host read per layer and micro-batch); metrics() reads them once."""
    import types

    from verl_hpc.engines.megatron.route_replay import RouteReplay

    layers, top_k, rows, seq = 3, 2, 2, 5
    g = torch.Generator().manual_seed(0)

    class Replay:
        def __init__(self):
            self.target_topk_idx = torch.randint(0, 4, (seq * rows, top_k), generator=g)
            self.recorded = self.target_topk_idx.clone()
            self.recorded[:3] = (self.recorded[:3] + 1) % 4  # 3 tokens routed elsewhere

        def get_recorded_indices(self):
            return self.recorded

        def clear_indices(self):
            pass

    rr = RouteReplay.__new__(RouteReplay)
    rr.layers, rr.top_k, rr.counting, rr.record = layers, top_k, True, False
    rr.routers = {layer: types.SimpleNamespace(router_replay=Replay()) for layer in range(layers)}
    rr._agree = torch.zeros(layers, dtype=torch.float64)
    rr._slots = torch.zeros(layers, dtype=torch.float64)
    mb = types.SimpleNamespace(dummy=False, model_input_ids=torch.zeros(rows, seq), packed=False, real_rows=rows)
    for _ in range(4):
        rr.after(mb)
    assert host_reads["n"] == 0
    assert rr._slots.tolist() == [4.0 * rows * seq * top_k] * layers
    agree = rr.metrics(torch.device("cpu"))
    assert 0.5 < agree["moe/route_agreement"] < 1.0 and set(agree) >= {f"moe/route_agreement/layer_{i}" for i in range(3)}
