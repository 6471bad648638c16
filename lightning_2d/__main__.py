from lightning_2d.cli import main

main()
