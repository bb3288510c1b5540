"""The collectives that the profiler and the runtime share: the process groups and issuers
the blocks go through (:mod:`.issuers`), the start-up agreement of ranks (:mod:`.agree`), and
the all-reduce sweep with its fit (:mod:`.sweep`). The profiler and the runtime import this
package, never each other.
"""
