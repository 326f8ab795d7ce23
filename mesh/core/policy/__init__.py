"""The admission policies an operator is most likely to want changed, one module each, each a
pure function of numbers with its own tests (``tests/unit/test_policy_*.py``):

- :mod:`.stages` — which stage a pool's state calls for, and which work each stage sheds;
- :mod:`.victims` — which admitted grant a full pool's urgent request may take back;
- :mod:`.retry_times` — when a refused or deferred request should come back.

:mod:`.settings` holds what they are tuned by (:class:`PressurePolicy`, :class:`Stage`). The
bookkeeping they are fed from — every pool's counters, holders and waiting requests — is the
pressure board's (:mod:`mesh.core.pressure`); to change a policy, change its module and its
test, not the board.
"""
