"""Both paths as two "nodes" on one machine (torchrun --nnodes 2 on 127.0.0.1, one process each): the multi-node
code path (node ranks, a rendezvous across launchers, Lightning's num_nodes) on CPU."""

import subprocess
import sys

import pytest

from shared.train.distributed import free_port
from tests.helpers import FAST, LIGHTNING, RAW, ROOT, env, load, torchrun

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", [RAW, LIGHTNING], ids=["raw", "lightning"])
def test_two_nodes_of_one_process_train_like_one_node_of_two(tmp_path, script):
    port = free_port()
    args = [*FAST, "--precision", "fp32"]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(r),
                               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
                               str(script), *map(str, args), "--out", str(tmp_path / f"node{r}.json")],
                              cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in (0, 1)]
    outs = [n.communicate(timeout=240)[0] for n in nodes]
    assert [n.returncode for n in nodes] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    two_nodes = load(tmp_path / "node0.json")  # global rank 0 writes the result
    assert two_nodes["world_size"] == 2 and not (tmp_path / "node1.json").exists()
    torchrun(script, 2, [*args, "--out", tmp_path / "one_node.json"])
    assert two_nodes["losses"] == pytest.approx(load(tmp_path / "one_node.json")["losses"], abs=1e-6)
