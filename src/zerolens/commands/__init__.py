"""commands: one module per verb (verify, bench, maxsize, sweep, estimate, plan): its arguments, its command
function, and the computation that is the verb's own. May import run/, report/, predict/ and everything below."""
