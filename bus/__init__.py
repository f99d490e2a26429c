"""The JetStream bus: the only package that imports nats.

Modules, one concern each (see docs/bus.md for the semantics as built):
    subjects    names of a run's streams, subjects, consumer groups, KV bucket
    connection  connect(cfg) -> Bus: reconnect, quiet errors, auth
    outage      ride / send: every broker call rides through an outage (one loop, one log line)
    errors      nats exceptions -> BusError (keeping the server's codes), at the boundary
    topology    declare(bus, cfg, run) -> RunBus (streams, consumers, RunKV), idempotent
    run         RunBus: one run's names, KV, publisher, groups, lag, end of data (`drained`)
    settlement  LeaseSettlement: how a Source settles items that hold leases
    publisher   Publisher: dedup ids, trace headers, windowed async PubAcks, safe retries
    pull        Puller: the cheap pull protocol under leases and replay
    lease       Leases (a consumer-group member) and Lease: fetch, ack/nak/term, heartbeat
    dead        dead_letter, list_dead: the DEAD stream with reasons and originals
    replay      replay (read a stream from a sequence), get, reposition (resume)
    lag         lag(bus, run, group): pending + ack-pending in messages and bytes
    status      run_status(bus, run): what `specbus status` prints
"""
