"""The operator commands: they start, watch and measure clusters, and are neither
the server nor the worker.

    ps-launch   (ps_tools.launch)         a server (or shards) and N workers on this machine
    ps-status   (ps_tools.status)         the cluster at a glance
    ps-export   (ps_tools.export)         a checkpoint or a live server as a Keras file
    ps-slurm    (ps_tools.slurm)          a Slurm task's role
    ps-compare  (ps_tools.study.compare)  modes x scenarios x seeds -> report (ps_tools.study.report)
    ps-advise   (ps_tools.study.advise)   measure a cluster or a launch, then recommend a mode

Here, the operator's own: ``launch``, ``status``, ``export``, ``slurm``, ``kube`` (what each
replica of a Kubernetes manifest runs with) and ``hosts`` (emulated machines). In
``ps_tools.study``, the study tools, which measure, simulate and compare runs of them.

The top layer: these may import ``ps_common``, ``protos``, ``worker`` and ``ps_server``.
The operator's commands do not import ``ps_tools.study``; the study tools may import
them (``tests/test_layers.py``).
"""
