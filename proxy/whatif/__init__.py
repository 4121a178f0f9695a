"""`slotwise whatif`: yesterday's timing log replayed against other settings (docs/whatif.md).

A discrete-event model of llama-server's slot loop (`server`, with `slots`, `ramcache`,
`stepcost`), costs calibrated from the log in the prefill gate's batch-cost form (`costs`,
`calibrate`, `serverobs` from llama-server's log, `modelfile` for one token's KV), the settings
(`settings`, `recorded`), the logged requests as the model runs them (`prompts`, `requests`,
`cutsizes`, `slotted`, `loras`, `kept`, `warmjobs`), slotwise's own prefill policy driven by the
model's clock through one seam (`gatekeeper`) and applied to the requests as the gate applies it
(`gating`), its kept KV and warm-ups (`keeping`, `warming`), and the records written by slotwise's
own record code (`flights`); `replay` runs them on one `clock`, `predict` wires inputs to outputs,
`check` compares with a real run, `synth` makes days for the tests and the worked example, `cli` is
the command. Pure, but for reading the files it is named: `cli`, `costs.load_costs`,
`settings.load_config_data`, and `modelfile` (a GGUF's header).
"""
