import os, subprocess, pytest
pytestmark = pytest.mark.cluster
def test_probe():
    d = os.environ["CLUSTER_DIR"]
    out = subprocess.run(["ip","netns","exec","rw-n1","unshare","--uts","sh","-c",'hostname n1; exec srun -N 3 hostname'], capture_output=True, text=True, env={**os.environ, "SLURM_CONF": f"{d}/slurm.conf"}, timeout=60)
    print(out.stdout, out.stderr)
    assert sorted(out.stdout.split()) == ["n1","n2","n3"]
