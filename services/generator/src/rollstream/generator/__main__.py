from rollstream.generator.service import main

main()
