"""The node-local tier: a checkpoint's files on each node's own disk, with copies on other nodes,
drained to the persistent tier (``save_dir``) in the background (docs/DEEPSPEED.md,
"Node-local tier").

Framework-free, one job per module: which node a rank is on and where its copies go
(`placement`), a node's local folder and what it holds (`local`), where each file of a load
comes from (`sources`), file bytes between ranks over torch.distributed (`transfer`), the copy of
a tag from the local tier to the persistent one (`drain`), and a rank's side of a save, its
drain and a restore, which the DeepSpeed engine calls (`tiered`).
"""
