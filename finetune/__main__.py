from finetune.cli import main

main()
