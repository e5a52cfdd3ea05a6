"""The tfps wire contract: ``tfps.proto``, its generated code, and the codec.

Regenerate with ``python -m protos.generate``; never edit ``*_pb2*`` by hand.
"""
