"""The study tools: which mode suits a model and a cluster, measured, simulated, compared.

    ps-compare  (compare)   modes x scenarios x seeds -> report.json, report.md, plots (report)
    ps-advise   (advise)    measure a cluster or a launch for a few steps, then recommend a mode

Owns:

- ``compare`` and ``report``: runs of ``ps-launch`` per mode, scenario and seed, and the report
  with its significance; ``compare_runs``: one such run (the scenarios, the modes' flags),
  below ``compare`` and ``virtual_validate``; ``compare_hosts``: the same runs on emulated
  hosts (``ps_tools.hosts``);
- ``virtual``, ``virtual_compare`` and ``virtual_validate`` (``ps-compare --virtual``): N
  simulated workers in virtual time, driving the real core; the report against N; the real
  runs it is checked against;
- ``advise`` (``ps-advise``: the profile measured), ``advise_rules`` (the rules that read a
  step profile, below both) and ``advise_predict`` (``ps-advise --predict``): the profile
  simulated at the user's N and link.

May import what ``ps_tools`` may (the shared layer, ``worker``, ``ps_server``) and the
operator's commands beside it (``ps_tools.launch``, ``ps_tools.hosts``); they do not import
it (``tests/test_layers.py`` holds the rule table).
"""
