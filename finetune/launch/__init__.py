"""The launcher's side: what starts a planned job's ranks and follows them, apart from the ranks themselves.

stopping.py   torchrun in a session of its own that dies with ft; stop signals passed on once as a stop request
              the ranks read (the protocol and a rank's side are distributed/lifecycle.py)
netif.py      the network interface gloo binds on each node (GLOO_SOCKET_IFNAME)
slurm.py      `ft launch --slurm`: an sbatch script that runs ft train on every node
k8s.py        `ft launch --k8s`: a PyTorchJob (Kubeflow) or JobSet manifest, checked against the CRDs' own schemas
              and Kubernetes' core schemas (k8s_schema.py: jsonschema, kubernetes-validate; crds/)

The ranks never import this package; it builds on the Plan and on distributed/ (the rank command, NCCL's variables).
"""
