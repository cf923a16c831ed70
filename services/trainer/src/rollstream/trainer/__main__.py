from rollstream.trainer.service import main

main()
