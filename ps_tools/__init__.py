"""The operator commands: they start, watch and measure clusters, and are neither
the server nor the worker.

    ps-launch   (ps_tools.launch)   a server (or shards) and N workers on this machine
    ps-compare  (ps_tools.compare)  modes x scenarios x seeds -> report (ps_tools.report)
    ps-advise   (ps_tools.advise)   measure a cluster or a launch, then recommend a mode
    ps-status   (ps_tools.status)   the cluster at a glance
    ps-export   (ps_tools.export)   a checkpoint or a live server as a Keras file

The top layer: these may import ``ps_common``, ``protos``, ``worker`` and ``ps_server``.
"""
