"""`slotwise whatif`: yesterday's timing log replayed against other settings (docs/whatif.md).

A discrete-event model of llama-server's slot loop (`server`, with `ramcache`, `stepcost`), costs
calibrated from the log in the prefill gate's batch-cost form (`costs`, `calibrate`), the logged
requests as the model runs them (`prompts`, `requests`, `warmjobs`), slotwise's own prefill policy
driven by the model's clock through one seam (`gatekeeper`), its kept KV and warm-ups (`keeping`,
`warming`), and the records written by slotwise's own record code (`flights`); `replay` runs them
on one `clock`, `predict` wires inputs to outputs, `check` compares with a real run, `cli` is the
command. Everything but `cli` is pure.
"""
