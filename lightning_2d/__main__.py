from lightning_2d.tools.cli import main

main()
