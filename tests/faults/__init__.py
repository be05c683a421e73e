"""Fault injection: a 3-member etcd cluster, two registry replicas, a watcher and agent
processes under nemeses, and a checker over what every process recorded.

``python -m tests.faults --seed N --duration S`` runs it (see docs/faults.md);
``test_faults.py`` runs a short fixed-seed version in the default test suite.
"""
