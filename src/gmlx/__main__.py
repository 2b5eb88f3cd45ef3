from gmlx.cli.main import app

app(prog_name="gmlx")
