"""models: the models, written for one device (model.py, hf.py) and their data (data.py). May import only
the foundation (errors, compat, units): nothing here knows about ranks or strategies."""
